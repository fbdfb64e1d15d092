"""The docs' Python examples run, top to bottom, and their asserts hold."""
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(name):
    return FENCE.findall((DOCS / name).read_text())


@pytest.mark.parametrize("i", range(len(_blocks("getting-started.md"))))
def test_getting_started_block_runs(i):
    block = _blocks("getting-started.md")[i]
    exec(compile(block, f"getting-started.md[block {i}]", "exec"), {"__name__": "__docs__"})


def test_getting_started_has_examples():
    assert len(_blocks("getting-started.md")) >= 3


def test_readme_example_runs():
    readme = (DOCS.parent / "README.md").read_text()
    blocks = FENCE.findall(readme)
    assert blocks
    for b in blocks:
        exec(compile(b, "README.md", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("i", range(len(_blocks("higher-order.md"))))
def test_higher_order_block_runs(i):
    block = _blocks("higher-order.md")[i]
    exec(compile(block, f"higher-order.md[block {i}]", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("i", range(len(_blocks("fast-loops.md"))))
def test_fast_loops_block_runs(i):
    pytest.importorskip("scipy")
    block = _blocks("fast-loops.md")[i]
    exec(compile(block, f"fast-loops.md[block {i}]", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("i", range(len(_blocks("cuda.md"))))
def test_cuda_block_runs(i):
    pytest.importorskip("numba_cuda")  # runs in numba's CUDA simulator (tests/conftest.py)
    blocks = _blocks("cuda.md")
    exec(compile("\n".join(blocks[:i + 1]), f"cuda.md[blocks 0-{i}]", "exec"),
         {"__name__": "__docs__"})
