#!/usr/bin/env bash
# patches/make.sh UPSTREAM_DIR [REV]: regenerate the series against upstream commit REV (default: the pinned one).
#   In a throw-away clone of UPSTREAM_DIR at REV, the vendored-optimizer patch is rebuilt from optimizers/ with
#   patches/vendor.py and every other patch is applied with `git am --3way`; then patches/*.patch and
#   patches/series are rewritten (git format-patch) and, for a new REV, the pin in patches/lib.sh is updated.
#   If a patch does not apply, the hunks that failed are listed and the clone is kept for you to resolve:
#   fix the files there, `git add` them, `git am --continue`, then export with the command printed.
# patches/make.sh --export TREE: write the series from a clone left by a failed run (after you resolved it), or
#   from any sd-scripts clone whose commits since the pinned commit are the series.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

export_series() {  # export_series TREE BASE
    local tree=$1 base=$2 count
    count=$(git -C "$tree" rev-list --count "$base..HEAD")
    [[ $count -gt 0 ]] || die "no commits on top of ${base:0:8} in $tree"
    rm -f "$PATCH_DIR"/[0-9][0-9][0-9][0-9]-*.patch
    git -C "$tree" format-patch --quiet --zero-commit --no-signature --base="$base" -o "$PATCH_DIR" "$base..HEAD"
    (cd "$PATCH_DIR" && ls [0-9][0-9][0-9][0-9]-*.patch) >"$PATCH_DIR/series"
    if [[ $base != "$PINNED_COMMIT" ]]; then
        sed -i "s/^PINNED_COMMIT=.*/PINNED_COMMIT=$base/" "$PATCH_DIR/lib.sh"
        echo "pinned commit is now $base: update the commit named in patches/README.md"
    fi
    echo "wrote $count patches and patches/series against ${base:0:8}:"
    sed 's/^/  /' "$PATCH_DIR/series"
}

is_vendor_patch() {  # only new files under library/sr_optimizers/
    ! grep '^diff --git ' "$1" | grep -qv ' a/library/sr_optimizers/'
}

commit_vendored() {  # commit_vendored TREE PATCH: regenerate, commit with PATCH's author, date and message
    local tree=$1 patch=$2 info
    info=$(mktemp -d)
    git mailinfo "$info/msg" "$info/diff" <"$patch" >"$info/head"
    rm -rf "$tree/library/sr_optimizers"
    python3 "$PATCH_DIR/vendor.py" "$tree" >/dev/null
    git -C "$tree" add -A library/sr_optimizers
    { sed -n 's/^Subject: //p' "$info/head"; echo; cat "$info/msg"; } >"$info/message"
    GIT_AUTHOR_NAME=$(sed -n 's/^Author: //p' "$info/head") \
        GIT_AUTHOR_EMAIL=$(sed -n 's/^Email: //p' "$info/head") \
        GIT_AUTHOR_DATE=$(sed -n 's/^Date: //p' "$info/head") \
        git -C "$tree" commit --quiet --allow-empty -F "$info/message"
    rm -rf "$info"
}

[[ $# -ge 1 ]] || usage
if [[ $1 == --export ]]; then
    [[ $# -eq 2 ]] || usage
    tree=$(cd "$2" && pwd)
    base=$(cat "$tree/.git/sd-scripts-bf16-base" 2>/dev/null || echo "$PINNED_COMMIT")
    export_series "$tree" "$(require_commit "$tree" "$base")"
    exit 0
fi
[[ $# -le 2 ]] || usage
upstream=$(cd "$1" 2>/dev/null && pwd) || die "$1 does not exist"
require_upstream "$upstream"
base=$(require_commit "$upstream" "${2:-$PINNED_COMMIT}")

work=$(mktemp -d "${TMPDIR:-/tmp}/sd-scripts-bf16-make.XXXXXX")
tree=$work/sd-scripts
clone_at "$upstream" "$base" "$tree"
echo "$base" >"$tree/.git/sd-scripts-bf16-base"
echo "rebuilding the series on ${base:0:8} in $tree"

mapfile -t patches < <(series_files)
for patch in "${patches[@]}"; do
    name=$(basename "$patch")
    if is_vendor_patch "$patch"; then
        commit_vendored "$tree" "$patch"
        echo "  regenerated  $name (from optimizers/)"
    elif git -C "$tree" am --quiet --3way "$patch" >"$work/am.log" 2>&1; then
        echo "  applied      $name"
    else
        echo "  FAILED       $name"
        git -C "$tree" am --abort >/dev/null 2>&1 || true
        echo "hunks that do not apply (the rest applied; *.rej files hold the failed hunks):"
        (cd "$tree" && git apply --reject --verbose "$patch" 2>&1 | grep -E '^(Applying patch|Rejected hunk|error: patch failed)' \
            | sed 's/^/  /') || true
        message=$work/$name.message
        git mailinfo "$work/msg" /dev/null <"$patch" | sed -n 's/^Subject: //p' >"$message"
        { echo; cat "$work/msg"; } >>"$message"
        echo "resolve in $tree: edit the files (see the *.rej files), delete the .rej files, then"
        echo "  git -C $tree add -A && git -C $tree commit -F $message"
        echo "apply the patches after it with git -C $tree am --3way PATCH (resolving likewise), then"
        echo "  $0 --export $tree"
        exit 1
    fi
done
export_series "$tree" "$base"
rm -rf "$work"
