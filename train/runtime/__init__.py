"""The runtime room of train/ (see README "Layout")."""
