"""The block IR: types (shape/deps), well-formedness checks, validation, printing."""

import pytest

from bbrules.ir import (SUM, MAX, Binary, BlockProgram, BlockReduce, Const, Dim, Dot, Get, IRError,
                        Kernel, Load, Monoid, Node, Reduce, Store, TensorDecl, Tuple, Unary, Var,
                        deps, loops_under, postorder, sched_deps, shape, show_kernel, show_node,
                        type_of, validate)

Q = Load("Q", ("q", "d"))
K = Load("K", ("k", "d"))
V = Load("V", ("k", "d"))
S = Binary("mul", Reduce("d", SUM, Dot("d", Q, K)), Const(0.125))

# online softmax over (running max, numerator): the numerator is rescaled as the max grows
ONLINE = Monoid(
    "test_online", ("m", "o"),
    (Const(float("-inf")), Const(0.0)),
    (Binary("max", Var("a.m"), Var("b.m")),
     Binary("add",
            Binary("mul", Var("a.o"), Unary("exp", Binary("sub", Var("a.m"),
                                                          Binary("max", Var("a.m"), Var("b.m"))))),
            Binary("mul", Var("b.o"), Unary("exp", Binary("sub", Var("b.m"),
                                                          Binary("max", Var("a.m"), Var("b.m"))))))),
    (Var("m"), Var("o")),
)


def test_load_spans_and_depends_on_its_axes():
    assert shape(Q) == deps(Q) == {"q", "d"}


def test_dot_contracts_the_axis_and_keeps_dependencies():
    t = type_of(Dot("d", Q, K))
    assert t.shape == {"q", "k"}
    assert t.deps == {"q", "k", "d"}


def test_reduce_removes_its_axis_from_dependencies():
    assert deps(S) == {"q", "k"} and shape(S) == {"q", "k"}
    m = Reduce("k", MAX, BlockReduce("max", "k", S))
    assert shape(m) == {"q"} and deps(m) == {"q"}


def test_loops_under_are_the_reductions_a_walk_of_the_dag_finds():
    inner = Reduce("k", SUM, BlockReduce("sum", "k", Binary("mul", S, V)))
    outer = Binary("add", inner, Reduce("k", MAX, BlockReduce("max", "k", S)))
    for n in (Q, S, inner, outer):
        assert loops_under(n) == {r for r in postorder(n) if isinstance(r, Reduce)}
    assert len(loops_under(outer)) == 3


def test_binary_broadcasts_by_axis_name():
    m = Reduce("k", MAX, BlockReduce("max", "k", S))
    assert shape(Binary("sub", S, m)) == {"q", "k"}


def test_tuple_components_are_typed_separately():
    s = BlockReduce("max", "k", S)
    o = Dot("k", Unary("exp", Binary("sub", S, s)), V)
    r = Reduce("k", ONLINE, Tuple((s, o)))
    assert deps(Get(0, r)) == {"q"}
    assert deps(Get(1, r)) == {"q", "d"}
    assert sched_deps(Get(0, r)) == {"q", "d"}


@pytest.mark.parametrize("bad, message", [
    (BlockReduce("sum", "x", Q), "does not span"),
    (Dot("k", Q, K), "does not span"),
    (Reduce("q", SUM, Q), "still spans"),
    (Reduce("d", ONLINE, BlockReduce("sum", "d", Q)), "folds 2 values, got 1"),
    (Get(0, Q), "no component"),
    (Unary("frobnicate", Q), "unknown unary"),
])
def test_ill_formed_terms_are_rejected(bad, message):
    with pytest.raises(IRError, match=message):
        type_of(bad)


def _program(*kernels: Store, outputs=("O",)) -> BlockProgram:
    dims = {"q": Dim("q", 8, 4), "k": Dim("k", 8, 4), "d": Dim("d", 4, 4)}
    tensors = {
        "Q": TensorDecl("Q", ("q", "d"), role="input"),
        "K": TensorDecl("K", ("k", "d"), role="input"),
        "S": TensorDecl("S", ("q", "k")),
        "O": TensorDecl("O", ("q", "k"), role="output"),
    }
    return BlockProgram.of_stores(dims, tensors, kernels, outputs)


def test_validate_accepts_a_well_formed_program():
    validate(_program(Store("S", ("q", "k"), S),
                      Store("O", ("q", "k"), Unary("exp", Load("S", ("q", "k"))))))


@pytest.mark.parametrize("kernels, message", [
    ((Store("O", ("q", "k"), Dot("d", Q, K)),), "shape == deps"),
    ((Store("O", ("q", "k"), Unary("exp", Load("S", ("q", "k")))),), "before any kernel"),
    ((Store("Q", ("q", "d"), Q),), "input tensor"),
    ((Store("O", ("k", "q"), S),), "does not match"),
    ((Store("S", ("q", "k"), S),), "never stored"),
])
def test_validate_names_the_violation(kernels, message):
    with pytest.raises(IRError, match=message):
        validate(_program(*kernels))


_SCORES = Store("S", ("q", "k"), S)
_EXP = Store("O", ("q", "k"), Unary("exp", S))


@pytest.mark.parametrize("kernels, message", [
    ((Kernel(("q",), (_SCORES, _EXP)),), None),  # two stores, k a map loop of both
    ((Kernel(("q",), ()),), "stores nothing"),
    ((Kernel(("q",), (_SCORES, _SCORES)),), "stores one tensor twice"),
    ((Kernel.of(_SCORES), Kernel(("q",), (_SCORES, _EXP))), "'S' is stored twice"),
    ((Kernel(("q", "z"), (_SCORES, _EXP)),), "unknown grid axis 'z'"),
    ((Kernel(("q", "q"), (_SCORES, _EXP)),), "repeated grid axis"),
    ((Kernel(("q", "d"), (_SCORES, _EXP)),), r"grid axes \['d'\] are not axes of S"),
    ((Kernel(("q",), (_SCORES, Store("O", ("q", "k"), Unary("exp", Load("S", ("q", "k")))))),),
     "O reads 'S', which the same kernel stores"),
])
def test_validate_checks_kernels_of_several_stores(kernels, message):
    p = _program()
    p = BlockProgram(p.dims, p.tensors, kernels, ("O",))
    if message is None:
        validate(p)
    else:
        with pytest.raises(IRError, match=message):
            validate(p)


def test_monoids_of_one_name_defined_differently_stay_apart():
    """A reduction holds its monoid: two definitions of one name are two reductions, typed
    by their own definitions; only writing both into one program is refused."""
    plain = Monoid("test_online", ("s",), (Const(0.0),),
                   (Binary("add", Var("a.s"), Var("b.s")),), (Var("s"),))
    row = BlockReduce("max", "k", S)
    online = Reduce("k", ONLINE, Tuple((row, Dot("k", Unary("exp", Binary("sub", S, row)), V))))
    summed = Reduce("k", plain, row)
    assert summed != Reduce("k", SUM, row) and deps(summed) == {"q"}
    assert isinstance(type_of(online), tuple)
    tensors = {"Q": TensorDecl("Q", ("q", "d"), role="input"),
               "K": TensorDecl("K", ("k", "d"), role="input"),
               "V": TensorDecl("V", ("k", "d"), role="input"),
               "O": TensorDecl("O", ("q",), role="output"),
               "P": TensorDecl("P", ("q",), role="output")}
    dims = {"q": Dim("q", 8, 4), "k": Dim("k", 8, 4), "d": Dim("d", 4, 4)}
    both = BlockProgram.of_stores(dims, tensors, (Store("O", ("q",), summed),
                                                  Store("P", ("q",), Get(0, online))),
                                  ("O", "P"))
    with pytest.raises(IRError, match="two different monoids named 'test_online'"):
        validate(both)


def test_printing_uses_infix_with_minimal_parentheses():
    e = Binary("mul", Binary("sub", Q, Const(1.0)), Binary("add", Q, Const(-2.0)))
    assert show_node(e) == "(load(Q[q, d]) - 1.0) * (load(Q[q, d]) + (-2.0))"
    assert show_node(Binary("sub", Q, Binary("sub", Q, Q))) == \
        "load(Q[q, d]) - (load(Q[q, d]) - load(Q[q, d]))"


def test_shared_subterms_print_once_as_let_bindings():
    e = Unary("exp", Binary("sub", S, Reduce("k", MAX, BlockReduce("max", "k", S))))
    text = show_kernel(Kernel.of(Store("E", ("q", "k"), e)))
    assert text.count("dot(d,") == 1
    assert "let t0 = " in text


def _doubling(depth: int, leaf: Node) -> Node:
    x = leaf
    for _ in range(depth):
        x = Binary("add", x, x)
    return x


def test_equality_of_separately_built_dags_is_linear_not_a_tree_walk():
    # As trees these have 2^60 leaves: a tree-walking comparison would never finish.
    assert _doubling(60, Load("Q", ("q", "d"))) == _doubling(60, Load("Q", ("q", "d")))
    assert _doubling(60, Load("Q", ("q", "d"))) != _doubling(60, Load("K", ("k", "d")))
    assert Tuple((Q, K)) != Tuple((Q, K, V)) and Tuple((Q, K)) == Tuple((Q, K))
