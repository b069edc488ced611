"""gpufeed worker: Redis Streams in, batched GPU inference, results out."""
