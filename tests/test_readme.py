"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

# What the README's fragments take as given: a zoo model, its optimizer, a batch and a step.
GIVEN = """
import torch
import torch.nn.functional as F
import timm
import revnets

model = timm.create_model("revnet38")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, target = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
example_input = x

def train_step(model, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), target).backward()
    optimizer.step()
"""


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_example_runs(index):
    namespace: dict = {}
    exec(compile(GIVEN, "<given>", "exec"), namespace)
    exec(compile(python_blocks()[index], f"README.md python block {index + 1}", "exec"), namespace)
