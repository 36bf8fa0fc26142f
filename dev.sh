#!/bin/sh
# Set-up and everyday commands. Needs only Python 3.11+ with venv and pip.
#   ./dev.sh main    run the main job: the CO2 forecast notebook on a local kernel
#   ./dev.sh test    run the test suite, on a pytest-xdist worker per core (-n 0: in one process)
#   ./dev.sh lint    mypy and ruff
#   ./dev.sh docs    build the documentation site into site/ (strict: a broken link fails)
#   ./dev.sh bench   slow scale tests, then benchmarks (bench/README.md)
set -eu
cd "$(dirname "$0")"

venv="${PREFECT_SANDBOX_VENV:-.venv}"
python="${PYTHON:-python3}"

# Set-up progress goes to stderr, one line before each step that takes a while; pip stays quiet.
say() {
    echo "dev.sh: $*" >&2
}

# Local kernels run under bubblewrap by default (docs/backends/local.md); install it if we may.
ensure_bwrap() {
    command -v bwrap >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing bubblewrap (bwrap), which isolates local kernels: apt-get install -y bubblewrap"
        apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
            { apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } ||
            say "could not install bubblewrap; see docs/troubleshooting.md"
    else
        say "bwrap not found. Local kernels run under bubblewrap by default and will not" \
            "start without it: install it (Debian/Ubuntu: sudo apt-get install bubblewrap)," \
            "or set isolation='none' on LocalKernelBackend knowingly"
    fi
}

setup() {
    ensure_bwrap
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
            echo "dev.sh: Python 3.11 or newer is needed (set PYTHON=...)" >&2
            exit 2
        }
        say "creating the virtual environment $venv"
        "$python" -m venv "$venv"
    fi
    # Reinstall only when the project's requirements changed since the last install.
    stamp="$venv/.prefect-sandbox-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        say "upgrading pip in $venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        say "installing prefect-sandbox and its extras into $venv (a few minutes the first time)"
        "$venv/bin/python" -m pip install --quiet -e '.[dev]'
        touch "$stamp"
        say "$venv is ready"
    fi
}

# pytest-xdist's options for `test`: a worker per core, each taking a test module at a time (so a
# module's fixtures are made once), unless the arguments already say how many workers (-n 0: none).
workers() {
    for arg in "$@"; do
        case "$arg" in
            -n | -n* | --numprocesses | --numprocesses=* | --dist | --dist=* | no:xdist | -pno:xdist)
                return 0
                ;;
        esac
    done
    echo "-n auto --dist loadscope"
}

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
    main)
        setup
        exec "$venv/bin/prefect-sandbox" run examples/co2/forecast.ipynb \
            --input examples/co2/co2.csv \
            --artifact 'figures/*.png' --artifact forecast.csv --artifact metrics.json \
            --out out "$@"
        ;;
    test)
        setup
        # shellcheck disable=SC2046  # the options are words
        exec "$venv/bin/python" -m pytest $(workers "$@") "$@"
        ;;
    lint)
        setup
        "$venv/bin/python" -m mypy
        "$venv/bin/python" -m ruff check .
        "$venv/bin/python" -m ruff format --check .
        ;;
    docs)
        setup
        # Material for MkDocs prints a banner about MkDocs 2.0 on every build; we pin MkDocs 1.
        NO_MKDOCS_2_WARNING=1 exec "$venv/bin/mkdocs" build --strict "$@"
        ;;
    bench)
        setup
        "$venv/bin/python" -m pytest -m slow -s --timeout 900
        "$venv/bin/python" bench/bench_local.py "$@"
        "$venv/bin/python" bench/bench_output.py
        "$venv/bin/python" bench/bench_isolation.py
        "$venv/bin/python" bench/bench_warm_pool.py
        "$venv/bin/python" bench/bench_sweep.py
        "$venv/bin/python" bench/bench_session.py
        "$venv/bin/python" bench/bench_cli.py
        "$venv/bin/python" bench/bench_scale.py --databases sqlite --client-retries 12
        "$venv/bin/python" bench/bench_scale.py --databases postgres
        exec "$venv/bin/python" bench/bench_s3.py
        ;;
    *)
        echo "usage: ./dev.sh main|test|lint|docs|bench [args...]" >&2
        exit 2
        ;;
esac
