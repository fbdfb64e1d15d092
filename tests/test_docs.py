"""The docs' Python examples run, each block on its own (a reader copies one block, not the
page), and their asserts hold; the pages link each other and docs/api.md is fresh."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# unindented blocks: an indented one inside a list (design.md's register example) is a sketch
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(p.name for p in DOCS.glob("*.md"))


def _blocks(path):
    return FENCE.findall(path.read_text())


def _cases():
    for path in [ROOT / "README.md"] + [DOCS / p for p in PAGES]:
        for i, block in enumerate(_blocks(path)):
            # fast-loops.md's target="parallel" block compiles the parallel interpreter on a
            # cold cache (half a minute), which tests/test_replay.py would compile anyway
            yield pytest.param(path, i, block, id=f"{path.name}[{i}]")


@pytest.fixture
def small_cuda_blocks(monkeypatch):
    # the CUDA simulator runs each thread of a block as a Python thread, idle ones
    # included: 4 threads a block instead of 128 (tests/test_cuda.py does the same)
    from numba import config
    if config.ENABLE_CUDASIM:
        from tapegrad.interpreters import replay_cuda
        monkeypatch.setattr(replay_cuda, "THREADS", 4)


@pytest.mark.parametrize("path,i,block", list(_cases()))
def test_block_runs_alone(path, i, block, request):
    if "scipy" in block:
        pytest.importorskip("scipy")
    if path.name == "cuda.md":
        pytest.importorskip("numba_cuda")  # runs in numba's CUDA simulator (tests/conftest.py)
        request.getfixturevalue("small_cuda_blocks")
    exec(compile(block, f"{path.name}[block {i}]", "exec"), {"__name__": "__docs__"})


def test_pages_have_examples():
    for page in ("getting-started.md", "higher-order.md", "fast-loops.md", "cuda.md"):
        assert len(_blocks(DOCS / page)) >= 3, page


def test_index_and_mkdocs_list_every_page():
    index = (DOCS / "index.md").read_text()
    next_section = index[index.index("## Next"):]
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        if page == "index.md":
            continue
        assert f"]({page})" in next_section, f"index.md's Next does not link {page}"
        assert page in nav, f"mkdocs.yml's nav lacks {page}"
        assert f"(docs/{page})" in readme, f"README.md does not link docs/{page}"


def test_api_page_is_fresh():
    from tapegrad import _apidoc
    assert (DOCS / "api.md").read_text() == _apidoc.render(), \
        "docs/api.md is stale: run python -m tapegrad._apidoc"


def test_api_page_lists_every_op():
    from tapegrad.ops import OPS
    text = (DOCS / "api.md").read_text()
    for op in OPS:
        assert f"| {op.code} | {op.name} |" in text


def test_bench_commands_in_the_docs_parse():
    # every `python -m tapegrad.bench ...` the docs show is accepted, and selects cases
    from tapegrad.bench import __main__ as cli
    commands = set()
    for path in [ROOT / "README.md"] + [DOCS / p for p in PAGES]:
        # the suite's own command, not its submodules (tapegrad.bench.gradbench)
        commands.update(re.findall(r"python -m tapegrad\.bench(?![.\w])([^`\n]*)`",
                                   path.read_text()))
    assert commands
    for tail in commands:
        argv = [a.strip("'\"") for a in tail.split()]
        args = cli.build_parser().parse_args(argv)
        assert not cli.unmatched_patterns(cli.split_patterns(args.only)), tail


def test_extras_are_what_the_docs_say():
    import tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    # the simulator needs numba-cuda alone: no toolkit (about 500 MB of NVIDIA packages)
    cuda_reqs = [r for r in extras["test"] if r.startswith("numba-cuda")]
    assert cuda_reqs and not any("[" in r for r in cuda_reqs), extras["test"]
    assert any(r.startswith("numba-cuda[cu") for r in extras["cuda"])
    assert "torch==2.13.0" in extras["test"] and "torch==2.13.0" in extras["bench"]
    assert "matplotlib" in extras["plot"]
    started = (DOCS / "getting-started.md").read_text()
    for extra in ("test", "bench", "plot", "cuda"):
        assert f"'.[{extra}]'" in started, extra
