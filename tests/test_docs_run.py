"""Every ```sh and ```python block of README.md and docs/*.md runs, in order, as a reader who copies them would run them.

One shell script per page (blocks in page order, each announced so a failure names its block) runs in a fresh working
directory. Conventions: `<!-- docs-test: skip REASON -->` on the line directly before a fence leaves the block out;
`<!-- docs-test: file NAME -->` writes the block to NAME (relative to the working dir) before the blocks after it run.
```python blocks are written to a file and run with this interpreter; other languages run only as files.

Scaled down by the harness, not the product (PLAIT_DOCS_TEST=1 is set for the pages): `plait`, `torchrun` and
`mpirun` are shell functions that pass their arguments through `scale()` below (`train.steps=N` -> N // 50, at least
2; 2 steps when none are given; fed rounds and clients, audit folds and epochs, collective sizes capped). `plait`
itself then runs forked from the pytest worker's warm server (tests/helpers.py WarmCLI: the script's fds, working dir,
environment and exit status are the command's), not as a new interpreter importing torch again (~1.4 s of CPU each). A page in
docs/ starts where the README's Training block leaves a reader: `job.toml` (`plait config show > job.toml`) and
`runs/x` (a trained run) are in its working directory. docs/api.md is left to tests/test_api.py, which runs its
blocks in order (RUN_ELSEWHERE). The pages run two at a time (one per core): about 290 CPU
seconds in all, the README's Training block the largest part; blocks that repeat a command with flags another test
covers are skipped, saying which test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|file)\s+(.+?)\s*-->\s*$")
FENCE = re.compile(r"^```([\w-]*)\s*\n(.*?)^```\s*$", re.S | re.M)
BIN = Path(sys.executable).parent


@dataclass
class Block:
    page: str
    line: int
    lang: str
    body: str
    skip: str | None = None  # the reason
    file: str | None = None  # write it to this path


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text[:m.start()].count("\n") + 1
        before = text[:m.start()].rstrip("\n").splitlines()
        mark = MARKER.match(before[-1].strip()) if before else None
        b = Block(page.relative_to(ROOT).as_posix(), line, m.group(1), m.group(2))
        if mark and mark.group(1) == "skip":
            b.skip = mark.group(2)
        elif mark:
            b.file = mark.group(2)
        out.append(b)
    return out


def script(page: Path) -> str:
    """The page's runnable blocks as one bash script (files written where their block stands)."""
    scale = shlex.quote(str(Path(__file__).resolve()))
    py = shlex.quote(sys.executable)
    lines = ["set -eo pipefail",
             f'plait() {{ {py} {scale} plait "$@"; }}',
             f'torchrun() {{ {py} {scale} torchrun "$@"; }}',
             f'mpirun() {{ {py} {scale} mpirun "$@"; }}',
             "export -f plait torchrun mpirun"]
    for b in blocks(page):
        where = f"{b.page}:{b.line}"
        if b.skip:
            continue
        if b.file:
            eof = "PLAIT_DOCS_EOF"
            assert eof not in b.body
            lines += [f"echo '### {where}: writes {b.file}'", f"mkdir -p \"$(dirname {shlex.quote(b.file)})\"",
                      f"cat > {shlex.quote(b.file)} <<'{eof}'", b.body.rstrip("\n"), eof]
        elif b.lang == "sh":
            lines += [f"echo '### {where}'", b.body]
        elif b.lang == "python":
            name = f"_docs_{Path(b.page).stem}_{b.line}.py"
            lines += [f"echo '### {where}'", f"cat > {name} <<'PLAIT_DOCS_EOF'", b.body.rstrip("\n"), "PLAIT_DOCS_EOF",
                      f"{py} {name}"]
    lines.append("echo '### done'")
    return "\n".join(lines) + "\n"


def scale_plait(args: list[str]) -> list[str]:
    """A plait command line, scaled to seconds (see the module docstring)."""
    args = list(args)

    def cap(flag: str, most: int) -> bool:
        if flag in args and args.index(flag) + 1 < len(args):
            i = args.index(flag) + 1
            args[i] = str(min(int(args[i]), most))
            return True
        return False

    if args[:1] == ["train"]:
        given = False
        for i, a in enumerate(args):
            m = re.fullmatch(r"train\.steps=(\d+)", a)
            if m and i and args[i - 1] == "--set":
                args[i], given = f"train.steps={max(2, int(m.group(1)) // 50)}", True
        if not given and "--resume" not in args:
            args += ["--set", "train.steps=2"]
        args += ["--set", "train.sample_tokens=0"]
        if not any(a.startswith("log.report=") for a in args):
            args += ["--set", "log.report=false"]  # matplotlib's plots cost seconds a run; `plait report` still draws
        if not any(a.startswith("train.eval_samples=") for a in args):
            args += ["--set", "train.eval_samples=32"]
    elif args[:2] == ["fed", "simulate"]:
        if not cap("--rounds", 2):
            args += ["--rounds", "2"]
        cap("--clients", 10)
    elif args[:2] == ["data", "audit"]:
        args += [] if "--folds" in args else ["--folds", "2"]
        args += [] if "--epochs" in args else ["--epochs", "1"]
    elif args[:2] == ["bench", "collectives"] and "--sizes" in args:
        args[args.index("--sizes") + 1] = "1K:16K"
    return args


def scale(argv: list[str]) -> list[str]:
    """`plait ARGS`, or a launcher whose command is `plait ARGS` / `-m plait ARGS`: the command with plait's args scaled."""
    import shutil

    tool, rest = argv[0], argv[1:]
    real = str(BIN / tool) if (BIN / tool).exists() else shutil.which(tool) or tool
    if tool == "plait":
        return [str(BIN / "plait"), *scale_plait(rest)]
    for i, a in enumerate(rest):
        if a == "plait" and (tool != "torchrun" or (i and rest[i - 1] == "-m")):
            return [real, *rest[:i + 1], *scale_plait(rest[i + 1:])]
        if a == "plait.worker":
            break
    return [real, *rest]


def call_warm(path: str, argv: list[str]) -> int:
    """`plait ARGV` run by the test's WarmCLI server at path (tests/helpers.py: forked from its warm server) with this
    process's standard fds, working dir and environment; its exit status."""
    import json
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        socket.send_fds(s, [b"\0"], [0, 1, 2])
        ask = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        s.sendall(len(ask).to_bytes(4, "big") + ask)
        got = b""
        while len(got) < 4:
            chunk = s.recv(4 - len(got))
            if not chunk:
                print(f"docs test: the warm plait server at {path} hung up", file=sys.stderr)
                return 1
            got += chunk
    return int.from_bytes(got, "big")


if __name__ == "__main__":  # the run script's `plait`, `torchrun` and `mpirun`: scale, then run the real one (before
    cmd = scale(sys.argv[1:])  # pytest is imported below: ~0.1 s of every command the pages run)
    if sys.argv[1] == "plait" and os.environ.get("PLAIT_DOCS_WARM_CLI"):  # plait itself: from the warm server
        sys.exit(call_warm(os.environ["PLAIT_DOCS_WARM_CLI"], cmd[1:]))
    os.execv(cmd[0], cmd)

import pytest  # noqa: E402

DOC_PAGES = pages()


def run_env() -> dict:
    from helpers import ENV

    return {**ENV, "PLAIT_DOCS_TEST": "1", "PATH": f"{BIN}{os.pathsep}{ENV.get('PATH', os.environ['PATH'])}",
            "PYTHONPATH": ""}


def reader_start(base: Path) -> None:
    """What the README's Training block leaves a reader with: job.toml and a trained run runs/x (2 steps), scaled as the
    README's own run is (scale_plait: no sample, no report figures)."""
    from helpers import start_cli

    base.mkdir()
    for argv, out in ((["config", "show"], "job.toml"),
                      (scale_plait(["train", "job.toml", "--set", "train.steps=100", "--set", "log.progress=false",
                                    "--out", "runs/x"]), "train.log")):
        with open(base / out, "w") as f:
            proc = start_cli(argv, run_env(), base, {1: f.fileno(), 2: f.fileno() if out == "train.log" else 2})
            proc.join(300)
        assert proc.exitcode == 0, f"plait {' '.join(argv)}: exit {proc.exitcode}\n{(base / out).read_text()}"
    (base / "train.log").unlink()


def run_page(page: Path, root: Path, base: Path | None, warm: str | None = None) -> tuple[int, str]:
    """Run the page's script in a fresh working dir (docs/ pages: a copy of base); (exit status, output). warm: a
    WarmCLI's socket, which then runs the script's `plait` commands."""
    import shutil

    work = root / page.stem
    if base is None:
        work.mkdir()
    else:
        shutil.copytree(base, work, symlinks=True)
    (root / f"{page.stem}.sh").write_text(script(page))
    env = run_env() | ({"PLAIT_DOCS_WARM_CLI": warm} if warm else {})
    r = subprocess.run(["bash", str(root / f"{page.stem}.sh")], cwd=work, capture_output=True, text=True, env=env,
                       timeout=900)
    return r.returncode, r.stdout + r.stderr


# Pages whose every block another test already runs, in order, as a reader would: that test is their docs run. (A skip
# marker would not do: the other test reads the same page and honours the markers.)
RUN_ELSEWHERE = {
    "docs/api.md": "tests/test_api.py::test_docs_api_examples_run_in_order runs each of its blocks, in order, in one "
                   "folder (mycode.py written first) and checks what they print and write",
}


def runnable(page: Path) -> bool:
    if page.relative_to(ROOT).as_posix() in RUN_ELSEWHERE:
        return False
    return any((b.lang in ("sh", "python") and not b.skip) or b.file for b in blocks(page))


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory) -> dict:
    """Every page's script, two at a time (one per core): the README from an empty dir, docs/ pages from reader_start."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import WarmCLI

    root = tmp_path_factory.mktemp("docs_run")
    todo = [p for p in DOC_PAGES if runnable(p)]
    server = WarmCLI(root)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = {p: pool.submit(run_page, p, root, None, server.path) for p in todo if p.name == "README.md"}
            reader_start(root / "_base")
            futures |= {p: pool.submit(run_page, p, root, root / "_base", server.path) for p in todo
                        if p.name != "README.md"}
            return {p: f.result() for p, f in futures.items()}
    finally:
        server.close()


@pytest.mark.parametrize("page", DOC_PAGES, ids=[p.relative_to(ROOT).as_posix() for p in DOC_PAGES])
def test_the_pages_blocks_run_in_order(page, page_runs):
    if page not in page_runs:
        pytest.skip(RUN_ELSEWHERE.get(page.relative_to(ROOT).as_posix(), f"{page.name}: no block to run"))
    rc, out = page_runs[page]
    last = re.findall(r"^### (.+)$", out, re.M)
    assert rc == 0 and last and last[-1] == "done", \
        f"the block at {last[-1] if last else '?'} failed (exit {rc}):\n{out[-6000:]}"


def test_markers_stand_directly_before_a_fence():
    """A marker anywhere else would be silently ignored: every one must be followed by a fence."""
    for page in DOC_PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if "docs-test:" in line:
                assert MARKER.match(line.strip()), f"{page.name}:{i + 1}: malformed marker {line!r}"
                assert i + 1 < len(lines) and lines[i + 1].startswith("```"), f"{page.name}:{i + 1}: no fence after it"


def test_a_page_run_elsewhere_has_only_blocks_that_its_test_runs():
    """docs/api.md is left to tests/test_api.py, which runs its ```python blocks and writes its file blocks: a block of
    another kind there (a ```sh block, say) would be run by neither."""
    for name in RUN_ELSEWHERE:
        for b in blocks(ROOT / name):
            assert b.skip or b.file or b.lang == "python", f"{b.page}:{b.line}: a ```{b.lang} block that no test runs"
