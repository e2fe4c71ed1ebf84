"""epdraft.parallel: the draft's process groups on a DeviceMesh (`groups`), joining and leaving the
world (`world`), the health check (`health`), rank-prefixed logging (`log`), the local-rank
spawner for tests and benchmarks (`spawn`), and address helpers (`address`, torch-free, which the
launcher uses). Import the submodule you need: this package imports nothing on its own, so the
CLI can use `address` without loading torch."""
