"""Expert parallelism: the one mesh (``mesh``) and the expert-parallel transports."""
