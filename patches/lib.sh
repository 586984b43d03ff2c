# Shared shell functions of patches/check.sh and patches/make.sh (sourced, not run).

# The upstream commit the series is made against (full hash; README.md names it too).
PINNED_COMMIT=48d368fa557731ad0488c07304dfeba8c07910eb
PATCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROJECT_DIR=$(dirname "$PATCH_DIR")

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

# require_upstream DIR: DIR must be a git checkout of kohya-ss/sd-scripts.
require_upstream() {
    local dir=$1
    [[ -d $dir ]] || die "$dir does not exist; give the path of a kohya-ss/sd-scripts clone (see patches/README.md)"
    git -C "$dir" rev-parse --git-dir >/dev/null 2>&1 || die "$dir is not a git repository"
    [[ -f $dir/train_network.py || $(git -C "$dir" rev-parse --is-bare-repository) == true ]] \
        || die "$dir does not look like sd-scripts (no train_network.py)"
}

# require_commit DIR REV: print REV's full hash, or fail saying how to get it.
require_commit() {
    local dir=$1 rev=$2 full
    full=$(git -C "$dir" rev-parse --verify --quiet "$rev^{commit}") \
        || die "commit $rev is not in $dir; run: git -C $dir fetch https://github.com/kohya-ss/sd-scripts.git main"
    echo "$full"
}

# clone_at SRC REV DEST: a throw-away clone of SRC at REV (detached) in DEST, sharing SRC's objects.
# Snapshots that lack some large blobs (partial mirrors) still work: those paths are left out of the work tree
# with sparse-checkout and the index's cache-tree is primed from REV, so commits and `git am` never need them.
clone_at() {
    local src=$1 rev=$2 dest=$3 missing
    git clone --quiet --shared --no-checkout "$src" "$dest"
    git -C "$dest" config user.name "sd-scripts-bf16"
    git -C "$dest" config user.email "sd-scripts-bf16@users.noreply.github.com"
    git -C "$dest" config advice.detachedHead false
    missing=$(git -C "$dest" ls-tree -r "$rev" | awk '$2 == "blob" {print $3}' \
        | git -C "$dest" cat-file --batch-check | awk '$2 == "missing" {print $1}')
    if [[ -n $missing ]]; then
        local patterns=('/*') oid path
        while read -r oid; do
            while IFS= read -r path; do patterns+=("!/$path"); done \
                < <(git -C "$dest" ls-tree -r "$rev" | awk -v o="$oid" '$3 == o {sub(/^[^\t]*\t/, ""); print}')
        done <<<"$missing"
        echo "note: $(wc -w <<<"$missing") blob(s) missing in $src; left out of the throw-away work tree" >&2
        git -C "$dest" sparse-checkout set --no-cone "${patterns[@]}" >/dev/null 2>&1
    fi
    git -C "$dest" checkout --quiet --detach "$rev" 2>/dev/null || true
    git -C "$dest" read-tree -m -u HEAD
    [[ $(git -C "$dest" rev-parse HEAD) == $(git -C "$dest" rev-parse "$rev^{commit}") ]] \
        || die "could not check out $rev in $dest"
}

# series_files: the patch files named in patches/series, in order (comments and blank lines skipped).
series_files() {
    local name
    while IFS= read -r name; do
        name=${name%%#*}
        name=${name//[[:space:]]/}
        [[ -n $name ]] && echo "$PATCH_DIR/$name"
    done <"$PATCH_DIR/series"
}
