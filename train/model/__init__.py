"""The model room of train/ (see README "Layout")."""
