"""`searchr1 local`: the whole stack on one machine as supervised processes."""
