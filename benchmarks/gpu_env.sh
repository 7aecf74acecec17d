# Sourced by the GPU scripts (gpu_vectorize.sh, gpu_check.sh) with PY set: pflkit from this
# checkout's src/ (a lent machine does not install it), and the kit that benchmarks/gpu_kit.sh
# gathered, where one was carried (GPUKIT, default .gpukit): its wheels installed into a
# folder of their own and put on the path, its Fashion-MNIST used as pflkit's data folder
# and linked where the tests look for it, and its PFLlib as PFLLIB unless one is given.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
GPUKIT=${GPUKIT:-.gpukit}
if [ -d "$GPUKIT" ]; then
    GPUKIT=$(cd "$GPUKIT" && pwd)
    if compgen -G "$GPUKIT/whl/*.whl" >/dev/null; then
        site=/tmp/pflkit-gpukit-site
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$GPUKIT"/whl/*.whl || { echo "gpu_env.sh: installing $GPUKIT/whl failed" >&2; exit 2; }
        export PYTHONPATH="$PYTHONPATH:$site"
    fi
    if [ -d "$GPUKIT/data/fashion_mnist" ]; then
        export PFLKIT_DATA="$GPUKIT/data"
        system=${FMNIST_SYSTEM:-/usr/share/datasets/fashion-mnist}  # where the tests find it
        if [ ! -e "$system" ]; then
            mkdir -p "$(dirname "$system")" 2>/dev/null \
                && ln -s "$GPUKIT/data/fashion_mnist" "$system" 2>/dev/null \
                || echo "gpu_env.sh: could not link $system: the tests that read Fashion-MNIST will fail" >&2
        fi
    fi
    if [ -z "${PFLLIB:-}" ] && [ -f "$GPUKIT/PFLlib/system/main.py" ]; then
        PFLLIB="$GPUKIT/PFLlib"
    fi
fi
$PY -c "import pflkit" || { echo "gpu_env.sh: $PY cannot import pflkit (see above); run benchmarks/gpu_kit.sh here and carry its folder" >&2; exit 2; }
