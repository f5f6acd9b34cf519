"""Helpers the tests share: plain functions and classes (the fixtures live in tests/conftest.py).

- cli: `nobackfill` in this process (cli) or as a subprocess (run_cli), any command that must succeed (run_checked),
  and the files it reads
- world: the session's synthetic world (layout, sizes, settings, its item store), the real world's vocabulary limit
- app: the app started in process, with an httpx client over the ASGI transport
- servers: free ports, a private redis-server, a real `nobackfill serve` process (free_port and wait_ready are
  loadtest/benchlib.py's)
- stores: what the pgvector, Qdrant and Milvus tests share (the items, the backfill CLI, the migration's steps)
- upgrade_standin: a small stand-in upgrade written as .npy splits (`python -m tests.support.upgrade_standin`)
- digits_models: a real 5 -> 10 class upgrade on sklearn's digits
- tiny_models: tiny random real models (CLIP, static) for the real backends' code paths
- faulty_encoder: the test-only `faulty-*` encoder backends (run as a script by chaos, loaded as a plug-in)
"""
