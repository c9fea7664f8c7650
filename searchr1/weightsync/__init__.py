"""Live weight updates from a trainer to inference engines, one package for both sides.

`protocol` (the HTTP contract of the weight routes both engines answer, and the engine calls
the senders drive), `session` (the pause and update session both senders run around a push,
`PushStats`), the broadcast: `group` (the process group the tensors go over), `sender`
(`WeightSender`, the trainer side) and `receiver` (`WeightLoader`, our engine's side); the
hand-over in memory: `handover` (the described format, `HandoverSender`) and
`handover_receiver` (`HandoverReceiver`, our engine's side); and delta updates: `delta` (the
per-tensor codec and the weights' checksum) and `baseline` (what the sender last delivered,
encoded against).
"""
