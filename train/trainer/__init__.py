"""The trainer room of train/ (see README "Layout")."""
