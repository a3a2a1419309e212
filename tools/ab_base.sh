#!/usr/bin/env bash
# Writes an A/B overlay: the files of this checkout as they were at a git revision, for
# tools/gpu_check.sh's ab stage (AB_OVERLAY=DIR), so that "this tree at REV" (A) can be built
# and timed against the working tree (B) on a machine that has the tree but no git history.
#
#   tools/ab_base.sh REV DIR
#
# DIR gets, at their paths, the REV content of every file that differs between REV and the
# working tree (modified or deleted since REV, committed or not), and DIR/.ab_removed lists the
# files that REV does not have (added since, tracked or untracked-not-ignored), which the ab
# stage deletes from its copy. DIR is emptied first.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: tools/ab_base.sh REV DIR" >&2
  exit 2
fi
rev=$1 dir=$2
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "ab_base: '$rev' is not a commit" >&2; exit 2; }
rm -rf "$dir"
mkdir -p "$dir"
: >"$dir/.ab_removed"
n=0
while IFS=$'\t' read -r status path; do
  case "$status" in
    A) echo "$path" >>"$dir/.ab_removed" ;;
    *)
      mkdir -p "$dir/$(dirname "$path")"
      git show "$rev:$path" >"$dir/$path"
      n=$((n + 1))
      ;;
  esac
done < <(git diff --no-renames --name-status "$rev" --)
git ls-files --others --exclude-standard >>"$dir/.ab_removed"
echo "ab_base: $n file(s) as at $(git rev-parse --short "$rev"), $(wc -l <"$dir/.ab_removed") to remove, in $dir"
