"""The data room of train/ (see README "Layout")."""
