"""One adapter per model family: what is split, not how."""
