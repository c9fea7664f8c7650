"""`searchr1 inspect`: a web page over a run directory (rollouts, loss masks, searches, rewards,
training curves). Reads files only; imports no service package."""
