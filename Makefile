# The two entry points: `make demo` trains the demo model; `make test` builds and runs every test.
# On a GPU machine without a package manager, scripts/gpu_test.sh builds and runs the GPU tests.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: deps build demo test clean

deps:
	@bash scripts/install_deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release > $(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/moetrain train

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@n=$$(grep -c "skipped: no GPU" $(BUILD)/Testing/Temporary/LastTest.log || true); \
	  if [ "$$n" != 0 ]; then echo "$$n GPU tests skipped: no GPU (run scripts/gpu_test.sh on a GPU machine)"; fi

clean:
	rm -rf $(BUILD) $(BUILD).configure.log
