# libsparge in a container: the library with its CUDA backend (the default
# architecture list, sm_80 to sm_120: docs/BUILDING.md), the sparge tool, the
# test suite (Catch2 v3 from Ubuntu 24.04) and the Python package, on NVIDIA's
# CUDA 13 development image. Building needs no GPU; running on one needs the
# NVIDIA Container Toolkit (docker run --gpus ...).
#
#   docker build -t libsparge .
#   docker run --rm --gpus all libsparge                            # the main job (scripts/run.sh)
#   docker run --rm --gpus all libsparge bash scripts/test.sh       # every test, GPU tests included
#   docker run --rm --gpus all libsparge python3 -c 'import sparge; print(sparge.has_cuda())'
#
# The library, its header, CMake package and pkg-config file are installed under
# /usr/local; the build folder stays at /opt/libsparge/build for the scripts.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      cmake ninja-build g++ make binutils catch2 \
      python3 python3-venv python3-pip python3-numpy python3-pytest python3-setuptools python3-wheel \
 && rm -rf /var/lib/apt/lists/*

# A virtual environment over the distribution's numpy/pytest/setuptools, so pip
# installs the package without touching the system Python.
RUN python3 -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/cuda/bin:${PATH}

WORKDIR /opt/libsparge
COPY . .

# Library, tool and tests (SPARGE_BUILD_TESTS=ON: Catch2 must be found).
ARG JOBS=8
RUN bash scripts/deps.sh test --check \
 && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARGE_CUDA=ON -DSPARGE_BUILD_TESTS=ON \
 && cmake --build build -j "${JOBS}" \
 && cmake --install build --prefix /usr/local \
 && ldconfig

# The Python package from the source tree, on the installed library (a pip install of
# ./bindings/python would compile the library a second time through scikit-build-core).
ENV PYTHONPATH=/opt/libsparge/bindings/python SPARGE_LIBRARY=/usr/local/lib/libsparge.so
RUN cd / && python3 -c 'import sparge; print("sparge", sparge.library_version(), "cuda", sparge.has_cuda())'

# CPU checks that need no GPU: the tool's smoke tests, the header and export checks.
RUN ctest --test-dir build --output-on-failure -R '^(cli_|c99_header$|exported_symbols$)'

CMD ["bash", "scripts/run.sh"]
