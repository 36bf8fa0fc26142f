#!/bin/sh
# Set-up and everyday commands. Needs only Python 3.11+ with venv and pip.
#   ./dev.sh main    run the main job: the CO2 forecast notebook on a local kernel
#   ./dev.sh test    run the test suite, on two pytest-xdist workers per core (-n 0: in one process)
#   ./dev.sh lint    mypy and ruff
#   ./dev.sh docs    build the documentation site into site/ (strict: a broken link fails)
#   ./dev.sh bench   slow scale tests, then benchmarks (bench/README.md)
set -eu
cd "$(dirname "$0")"

venv="${PREFECT_SANDBOX_VENV:-.venv}"
python="${PYTHON:-python3}"

# Set-up progress goes to stderr: one line before each step that takes a while, and while pip
# installs, a line every 20 s saying how far it got (pip's own output goes to a log).
say() {
    echo "dev.sh: $*" >&2
}

# How far the pip whose log is $1 got: packages collected, then installing, then done.
pip_progress() {
    if grep -q '^Successfully installed' "$1"; then
        echo "installed"
    elif grep -q '^Installing collected packages' "$1"; then
        count=$(grep '^Installing collected packages' "$1" | tr ',' '\n' | wc -l | tr -d ' ')
        # Each package unpacked leaves its .dist-info folder (pip's own were there before).
        done=$(find "$venv"/lib/python*/site-packages -maxdepth 1 -name '*.dist-info' | wc -l)
        echo "unpacking packages (the longest step): about $((done - 2)) of $count done"
    else
        echo "$(grep -c '^Collecting' "$1") packages resolved"
    fi
}

# Run pip install "$@" in the background into its log, saying every 20 s how far it got; on
# failure print the log's tail. A signal stops pip too (a background job ignores SIGINT).
pip_install() {
    log="$venv/pip-install.log"
    "$venv/bin/python" -m pip install --progress-bar off "$@" >"$log" 2>&1 &
    pip_pid=$!
    trap 'kill "$pip_pid" 2>/dev/null; exit 130' INT
    trap 'kill "$pip_pid" 2>/dev/null; exit 143' TERM
    started=$(date +%s)
    next=20
    while kill -0 "$pip_pid" 2>/dev/null; do
        sleep 1
        elapsed=$(($(date +%s) - started))
        if [ "$elapsed" -ge "$next" ]; then
            say "  $(pip_progress "$log") after ${elapsed} s (pip's log: $log)"
            next=$((next + 20))
        fi
    done
    trap - INT TERM
    if ! wait "$pip_pid"; then
        tail -n 30 "$log" >&2
        say "pip install failed; its whole log: $log"
        exit 1
    fi
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
        say "upgrading pip in $venv (under a minute)"
        pip_install --upgrade pip
        say "installing prefect-sandbox and its extras into $venv: about 280 packages, 3-5" \
            "minutes with pip's cache warm on a quiet 2-core machine, 15 or more on a busy one"
        pip_install -e '.[dev]'
        touch "$stamp"
        say "$venv is ready"
    fi
    # pip compiles what it installs, but not an editable project, whose modules Python then
    # compiles in every process where PYTHONDONTWRITEBYTECODE is set (as on our machines): 0.3-0.5 s of
    # CPU in each process that imports the flows (a CLI's, a test's). Up to date: 0.05 s.
    "$venv/bin/python" -m compileall -q prefect_sandbox
}

# pytest-xdist's options for `test`: two workers per core (the tests mostly wait on kernels,
# servers and subprocesses: on 2 cores, 2 workers kept them 52% busy, 4 workers 74%; 6 workers
# beside two CPU burners took longer, 1722 s, and failed 11 timing checks), each taking
# a test module at a time (so a module's fixtures are made once) in collection order, where
# tests/conftest.py puts the longest first, unless the arguments already say how many workers
# (-n 0: none).
workers() {
    for arg in "$@"; do
        case "$arg" in
            -n | -n* | --numprocesses | --numprocesses=* | --dist | --dist=* | no:xdist | -pno:xdist)
                return 0
                ;;
        esac
    done
    echo "-n $((2 * $(nproc))) --dist loadscope --no-loadscope-reorder"
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
