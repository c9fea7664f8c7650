"""Live weight updates from a trainer to inference engines, one package for both sides.

`protocol` (the HTTP contract of the weight routes both engines answer, and the engine calls
the sender drives), `group` (the process group the tensors are broadcast over), `sender` (the
trainer side, `WeightSender`), `handover` (in memory, `HandoverSender`), `receiver` (our
reference engine's side, `WeightLoader`), and delta updates: `delta` (the per-tensor codec and
the weights' checksum) and `baseline` (what the sender last delivered, encoded against).
"""
