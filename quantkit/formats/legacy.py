"""placeholder: filled by its family."""
FORMATS = []
