"""`searchr1 demo`: a fully offline end-to-end run that visibly learns to search."""
