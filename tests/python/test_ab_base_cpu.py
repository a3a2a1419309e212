"""tools/ab_base.sh without a GPU: in a scratch git repository, the overlay holds the revision's version of every
file changed since (committed or not, deleted ones too) and lists the files added since (tracked or not) in
.ab_removed; laying it over a copy of the working tree as tools/gpu_check.sh's ab stage does gives the revision's
tree. A revision that is not a commit is refused."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "ab_base.sh")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _tree(root):
    files = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".git"]
        for n in names:
            p = os.path.join(d, n)
            with open(p) as f:
                files[os.path.relpath(p, root)] = f.read()
    return files


def test_overlay_rebuilds_the_revision(tmp_path):
    repo = tmp_path / "repo"
    os.makedirs(repo / "tools")
    shutil.copy(TOOL, repo / "tools" / "ab_base.sh")
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    _write(str(repo / ".gitignore"), "/ignored/\n")
    _write(str(repo / "src" / "a.cu"), "a at base\n")
    _write(str(repo / "src" / "gone.cu"), "gone at base\n")
    _write(str(repo / "docs" / "same.md"), "unchanged\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    base_tree = _tree(repo)
    # Since the base: a committed edit, an uncommitted edit, a deletion, a committed and an untracked new file,
    # and an ignored file (not part of either tree).
    _write(str(repo / "src" / "a.cu"), "a committed\n")
    _write(str(repo / "src" / "new.cu"), "new committed\n")
    os.remove(repo / "src" / "gone.cu")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "change")
    _write(str(repo / "docs" / "same.md"), "edited, not committed\n")
    _write(str(repo / "src" / "untracked.cu"), "untracked\n")
    _write(str(repo / "ignored" / "x.bin"), "ignored\n")

    overlay = tmp_path / "overlay"
    out = subprocess.run(["bash", str(repo / "tools" / "ab_base.sh"), base, str(overlay)], capture_output=True,
                         text=True, check=True).stdout
    assert "3 file(s)" in out
    files = _tree(overlay)
    assert files["src/a.cu"] == "a at base\n"
    assert files["src/gone.cu"] == "gone at base\n"
    assert files["docs/same.md"] == "unchanged\n"
    removed = set(files.pop(".ab_removed").split())
    assert removed == {"src/new.cu", "src/untracked.cu"}
    assert set(files) == {"src/a.cu", "src/gone.cu", "docs/same.md"}

    # The ab stage's assembly: a copy of the working tree, the overlay laid over it, the listed files removed.
    work = tmp_path / "work"
    shutil.copytree(repo, work, ignore=shutil.ignore_patterns(".git", "ignored"))
    shutil.copytree(overlay, work, dirs_exist_ok=True)
    for f in removed:
        os.remove(work / f)
    os.remove(work / ".ab_removed")
    assert _tree(work) == base_tree


def test_refuses_what_is_not_a_commit(tmp_path):
    r = subprocess.run(["bash", TOOL, "no-such-revision-xyz", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "not a commit" in r.stderr
    assert not os.path.exists(tmp_path / "o")
