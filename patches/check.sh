#!/usr/bin/env bash
# patches/check.sh UPSTREAM_DIR: apply the series to a throw-away clone of a clean upstream checkout at the pinned
# commit and run the checks on it (vendored copy == optimizers/, optimizer names and warning, SR accumulation).
# UPSTREAM_DIR itself is never modified.
#
# Environment: SD_CHECK_PYTHON  python with upstream's packages (default: a venv made from check-requirements.txt
#                               in SD_CHECK_VENV, default ${TMPDIR:-/tmp}/sd-scripts-bf16-upstream-venv)
#              SD_CHECK_E2E=1   also run harness/check_e2e.py: 2 steps of the patched train_network.py on a
#                               random-weight SD1.5 (about 1-2 min, 7 GB RAM, 2 GB in TMPDIR; needs this checkout's
#                               .venv or SD_CHECK_PROJECT_PYTHON to build the model, or SD_CHECK_E2E_MODEL=FILE)
#              SD_CHECK_E2E_SDXL=1  also run harness/check_e2e.py --sdxl: 2 steps of the patched
#                               sdxl_train_network.py on a random-weight SDXL at 256 px (about 20 min on 2 CPU
#                               threads, 12.5 GB RAM, 7 GB in TMPDIR)
#              SD_CHECK_E2E_FLUX=1  also run harness/check_e2e_flux.py: 2 steps of the patched
#                               flux_train_network.py on a random FLUX.1 at real widths, 2 double + 4 single
#                               blocks, 256 px (SD_CHECK_E2E_FLUX_MODEL=DIR reuses its four model files)
#              SD_CHECK_KEEP=1  keep the throw-away clone and print its path
# Exit: 0 all checks passed, or skipped with a "SKIP:" line when the python packages cannot be installed;
#       1 a check failed; 2 bad usage or an unusable UPSTREAM_DIR.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ $# -eq 1 ]] || { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
upstream=$(cd "$1" 2>/dev/null && pwd) || die "$1 does not exist"
require_upstream "$upstream"
base=$(require_commit "$upstream" "$PINNED_COMMIT")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

work=$(mktemp -d "${TMPDIR:-/tmp}/sd-scripts-bf16-check.XXXXXX")
if [[ ${SD_CHECK_KEEP:-0} == 1 ]]; then echo "keeping $work"; else trap 'rm -rf "$work"' EXIT; fi
tree=$work/sd-scripts
failed=0
started=$SECONDS

# 1. the series applies with git am on the pinned commit
clone_at "$upstream" "$base" "$tree"
mapfile -t patches < <(series_files)
if ! git -C "$tree" am --quiet "${patches[@]}" >"$work/am.log" 2>&1; then
    cat "$work/am.log"
    echo "FAIL git am: the series does not apply on ${base:0:8}"
    exit 1
fi
echo "ok   git am: ${#patches[@]} patches applied on ${base:0:8} ($(git -C "$tree" diff --shortstat "$base" HEAD))"
git -C "$tree" log --format='       %s' "$base..HEAD"

# 2. the vendored copy in the series is what patches/vendor.py makes from optimizers/ now
python_here=${PYTHON:-python3}
if "$python_here" "$PATCH_DIR/vendor.py" "$work/vendored" >/dev/null \
    && diff -r "$work/vendored/library/sr_optimizers" "$tree/library/sr_optimizers" >"$work/vendor.diff"; then
    echo "ok   vendored library/sr_optimizers == patches/vendor.py output from optimizers/"
else
    echo "FAIL vendored library/sr_optimizers differs from optimizers/: run patches/make.sh $upstream"
    head -20 "$work/vendor.diff"
    failed=1
fi

# 3. python with upstream's packages
if [[ -n ${SD_CHECK_PYTHON:-} ]]; then
    py=$SD_CHECK_PYTHON
else
    venv=${SD_CHECK_VENV:-${TMPDIR:-/tmp}/sd-scripts-bf16-upstream-venv}
    stamp=$venv/.check-requirements-$(sha1sum "$PATCH_DIR/check-requirements.txt" | cut -c1-12)
    if [[ ! -f $stamp ]]; then
        echo "..   installing upstream's packages into $venv (once; see patches/check-requirements.txt)"
        if ! { [[ -x $venv/bin/python ]] || python3 -m venv "$venv"; } >"$work/pip.log" 2>&1 \
            || ! "$venv/bin/pip" install --quiet -r "$PATCH_DIR/check-requirements.txt" >>"$work/pip.log" 2>&1 \
            || ! "$venv/bin/pip" install --quiet --no-deps torchvision==0.28.0 >>"$work/pip.log" 2>&1; then
            tail -5 "$work/pip.log"
            echo "SKIP: could not install upstream's python packages into $venv (no package index?);" \
                "set SD_CHECK_PYTHON to a python that has them"
            exit 0
        fi
        rm -f "$venv"/.check-requirements-* && touch "$stamp"
    fi
    py=$venv/bin/python
fi

run_harness() {
    (cd "$tree" && PYTHONPATH="$PATCH_DIR/harness" "$py" "$PATCH_DIR/harness/$1" "${@:2}") || failed=1
}

(cd "$tree" && "$py" -m py_compile library/train_util.py train_network.py library/sr_optimizers/*.py) \
    && echo "ok   patched files compile" || { echo "FAIL patched files do not compile"; failed=1; }
run_harness check_optimizers.py
run_harness check_accumulation.py
(cd "$tree" && PYTHONPATH="$PATCH_DIR/harness" timeout 600 "$py" -m torch.distributed.run --standalone \
    --nproc_per_node 2 "$PATCH_DIR/harness/check_accumulation_ddp.py" 2>"$work/ddp.log") \
    || { grep -v '^\[rank' "$work/ddp.log" | tail -5; echo "FAIL 2-process accumulation checks (torchrun, gloo)"; failed=1; }
if [[ ${SD_CHECK_E2E:-0} == 1 ]]; then
    run_harness check_e2e.py "$work/e2e"
else
    echo "--   end-to-end train_network.py run: skipped (SD_CHECK_E2E=1 runs it: 1-2 min, 7 GB RAM)"
fi
if [[ ${SD_CHECK_E2E_SDXL:-0} == 1 ]]; then
    run_harness check_e2e.py "$work/e2e-sdxl" --sdxl
else
    echo "--   end-to-end sdxl_train_network.py run: skipped (SD_CHECK_E2E_SDXL=1 runs it: about 20 min, 12.5 GB RAM)"
fi
if [[ ${SD_CHECK_E2E_FLUX:-0} == 1 ]]; then
    run_harness check_e2e_flux.py "$work/e2e-flux"
else
    echo "--   end-to-end flux_train_network.py run: skipped (SD_CHECK_E2E_FLUX=1 runs it)"
fi

if [[ $failed != 0 ]]; then
    echo "check.sh: FAILED ($((SECONDS - started)) s)"
    exit 1
fi
echo "check.sh: all checks passed ($((SECONDS - started)) s)"
