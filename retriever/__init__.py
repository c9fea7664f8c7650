"""Search service: drop-in Search-R1 /retrieve API (HTTP + gRPC), dense/BM25/web backends."""
