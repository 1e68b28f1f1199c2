"""The calculation task for tool use (m2flow/data/calculation.py): deterministic, its held-out
split held out by phrasing and by kind, every answer exact (checked against the calculator
tool on the problem's own expression)."""

import math

import pytest

from m2flow.data.calculation import HELD_OUT_KINDS, KINDS, calculation_problems, expression_of, phrasings
from m2flow.tools.calculator import calculator


def kind_of(problem):
    return problem.id.split("-")[1]


def phrasing_of(problem):
    kind = KINDS[kind_of(problem)]
    return kind.phrasings[int(problem.id.split("-")[2])]


def test_the_same_arguments_give_the_same_problems_and_others_others():
    a = calculation_problems(40, "train", seed=3)
    assert a == calculation_problems(40, "train", seed=3)
    assert a != calculation_problems(40, "train", seed=4)
    assert len({p.question for p in a}) == 40


def test_the_held_out_split_has_its_own_phrasings_and_kind():
    train, test = calculation_problems(300, "train"), calculation_problems(300, "test")
    assert {phrasing_of(p) for p in train}.isdisjoint({phrasing_of(p) for p in test})
    assert not {kind_of(p) for p in train} & set(HELD_OUT_KINDS)
    assert {kind_of(p) for p in test} == set(KINDS)  # every kind, the held-out one included
    assert {kind_of(p) for p in train} == set(KINDS) - set(HELD_OUT_KINDS)
    for kind in KINDS.values():
        assert set(phrasings(kind, "train")).isdisjoint(phrasings(kind, "test"))


def test_every_answer_is_the_calculators_value_of_its_expression():
    for p in calculation_problems(120, "train") + calculation_problems(60, "test"):
        value = float(calculator(expression_of(p)))
        assert math.isclose(value, float(p.answer), rel_tol=0, abs_tol=1e-9), (p.question, p.answer, value)
        assert "." not in p.answer or len(p.answer.split(".")[1]) <= 2
    with pytest.raises(ValueError, match="split"):
        calculation_problems(1, "dev")
