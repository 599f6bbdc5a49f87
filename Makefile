# The two entry points: `make demo` trains the demo model; `make test` builds and runs every test.
# On a GPU machine without a package manager, scripts/gpu_test.sh builds and runs the GPU tests.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: deps build demo test clean

deps:
	@bash scripts/install_deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMT_BUILD_TESTS=ON -DMT_PYTHON=ON > $(BUILD).configure.log 2>&1 \
	  || (cat $(BUILD).configure.log; exit 1)
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/moetrain train

# The C++ tests (CTest), then the Python package as a user gets it: `pip install .` into a fresh virtual
# environment (reusing $(BUILD)'s objects) and its tests (pytest, python/tests and examples/python).
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@n=$$(grep -c "skipped: no GPU" $(BUILD)/Testing/Temporary/LastTest.log || true); \
	  if [ "$$n" != 0 ]; then echo "$$n GPU tests skipped: no GPU (run scripts/gpu_test.sh on a GPU machine)"; fi
	rm -rf $(BUILD)/venv && python3 -m venv $(BUILD)/venv
	$(BUILD)/venv/bin/pip install -q --config-settings=build-dir=$(BUILD) ".[test]"
	MOETRAIN_BIN=$(abspath $(BUILD))/moetrain $(BUILD)/venv/bin/python -m pytest -q python/tests examples/python

clean:
	rm -rf $(BUILD) $(BUILD).configure.log
