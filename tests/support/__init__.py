"""The harnesses the tests share: private redis-servers and clusters, worker processes,
image servers, images, model directories and the CLI runner."""
