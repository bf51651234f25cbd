"""A linear (integer) program as plain arrays, solved whole by HiGHS, or by CBC through PuLP.

The ILP of ``passes/solver.py`` has tens of thousands of variables on a large mesh. Built as PuLP
objects (an ``LpVariable`` per variable, an ``LpAffineExpression`` dict per row), which PuLP's
HiGHS interface then re-reads one column and one row at a time (``addCol``, ``addRow``), the model
cost more than HiGHS's solve of it (benchmarks/README.md, "Planning time at scale"). Here a
variable is an index, a row a list of (index, coefficient) pairs, and HiGHS receives the whole
model in one ``passModel`` call as compressed columns. PuLP stays for CBC (always installed, with
PuLP's bundled binary) where highspy is not.

The model handed to either solver is the one PuLP built before: columns in the order of their
names (``LpProblem.variables()`` sorts by name, and HiGHS's branch and bound breaks ties between
equal optima by column order, so keeping it keeps the plans), rows in the order they are added,
coefficients summed per variable, zero coefficients left out, constants moved to the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pulp

from autopar.errors import SolverError
from autopar.passes.background import owner_idle


class Var:
    """A column of a ``Model``, by index (identity-hashed: terms of one variable are summed)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


# a term of a row or of the objective: (variable, coefficient); the variable may be the int 1 (a
# node with one strategy: a constant) or None (nothing), both folded into the row's bounds
Term = tuple


# the dual simplex's work before a relaxation asked for by the interior point method is left to
# it (``Model.relaxation``): iterations times the matrix's nonzeros
SIMPLEX_FIRST_WORK = 1e9


@dataclass(frozen=True)
class LpResult:
    """What a solve gave: the status in PuLP's words (``Optimal``, ``Infeasible``, ...), whether a
    solution is at hand, whether the time limit stopped it first, the columns' values, the
    objective, and the solver's name."""

    status: str
    has_solution: bool
    time_limited: bool
    values: np.ndarray
    objective: float
    solver: str
    # a MIP stopped by its node limit (``solve``'s ``node_limit``), with the least objective any
    # solution can have that its tree proved (-inf where it stopped before its root's bound)
    node_limited: bool = False
    bound: float = -math.inf


class Model:
    """A minimization: columns with bounds and integrality, rows ``lo <= sum a x <= hi``."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        # the rows' coefficients one row after another (column indices, values) and each row's
        # count: flat lists, which ``_arrays`` turns into arrays at once (a list per row cost a
        # generator pass over every coefficient there)
        self._row_cols: list[int] = []
        self._row_vals: list[float] = []
        self._row_sizes: list[int] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.cost: dict[int, float] = {}
        self.offset = 0.0
        self._built: tuple | None = None

    @property
    def num_variables(self) -> int:
        return len(self.names)

    @property
    def num_constraints(self) -> int:
        return len(self._row_sizes)

    @property
    def rows(self) -> Iterator[tuple[list[int], list[float]]]:
        """Each row's (column indices, coefficients), in the order they were added."""
        at = 0
        for n in self._row_sizes:
            yield self._row_cols[at : at + n], self._row_vals[at : at + n]
            at += n

    def var(self, name: str, lower: float = 0.0, upper: float = math.inf, integer: bool = False) -> Var:
        self.names.append(name)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return Var(len(self.names) - 1)

    def vars(self, names: list[str], lower: float, upper: float, integer: bool = False) -> list[Var]:
        """A column per name, all with these bounds and kind (``var`` each, at once)."""
        start = len(self.names)
        self.names.extend(names)
        n = len(names)
        self.lower.extend([lower] * n)
        self.upper.extend([upper] * n)
        self.integer.extend([integer] * n)
        return [Var(i) for i in range(start, start + n)]

    def set_upper(self, v: Var, upper: float) -> None:
        self.upper[v.index] = upper

    def objective(self, terms: Iterable[Term]) -> None:
        coefs, constant = _collect(terms)
        if not coefs:  # as PuLP does (``LpProblem.fixObjective``): no solver takes an empty model
            coefs = {self.var("__dummy", 0.0, 0.0): 1.0}
        self.cost = {v.index: c for v, c in coefs.items()}
        self.offset = constant

    def eq(self, terms: Iterable[Term], rhs: float) -> None:
        self._row(terms, rhs, rhs)

    def le(self, terms: Iterable[Term], rhs: float) -> None:
        self._row(terms, -math.inf, rhs)

    def ge(self, terms: Iterable[Term], rhs: float) -> None:
        self._row(terms, rhs, math.inf)

    def _row(self, terms: Iterable[Term], lo: float, hi: float) -> None:
        coefs, constant = _collect(terms)
        cols = [v.index for v, c in coefs.items() if c]
        self._row_cols.extend(cols)
        self._row_vals.extend([c for c in coefs.values() if c])
        self._row_sizes.append(len(cols))
        # as PuLP moves the constant: the bound is -(constant - rhs), the same float as rhs - constant
        self.row_lower.append(lo - constant if math.isfinite(lo) else lo)
        self.row_upper.append(hi - constant if math.isfinite(hi) else hi)

    def eq_distinct(self, columns: list[Var], coefs: list[float], rhs: float) -> None:
        """``eq`` of the terms ``zip(columns, coefs)`` where the caller knows them to be distinct
        columns with non-zero float coefficients (no constant, nothing to sum): the same row, built
        without ``_collect``'s pass (the ILP's linking rows, tens of thousands on a large mesh)."""
        self.row_distinct(columns, coefs, rhs, rhs)

    def row_distinct(self, columns: list[Var], coefs: list[float], lo: float, hi: float) -> None:
        """``lo <= sum coefs * columns <= hi`` on distinct columns, non-zero float coefficients."""
        self._row_cols.extend([v.index for v in columns])
        self._row_vals.extend(coefs)
        self._row_sizes.append(len(columns))
        self.row_lower.append(lo)
        self.row_upper.append(hi)

    def solve(
        self,
        solver: str,
        time_limit_s: float | None = None,
        node_limit: int | None = None,
        objective_bound: float | None = None,
    ) -> LpResult:
        """Solve with ``solver`` ("HiGHS" or "CBC", ``passes/solver.py:solver_name``). ``node_limit``
        (HiGHS only): stop the branch and bound after this many nodes (``mip_max_nodes``), with
        the best solution found, if any, and the tree's bound (``LpResult.node_limited``): a limit
        that counts work, not seconds, so the same model stops at the same place under any load.
        ``objective_bound`` (HiGHS only; its option of that name): the tree drops every node whose
        bound passes it, so the result is the optimum where that is under it, and otherwise no
        solution (``Infeasible``) or one over it."""
        if solver == "HiGHS":
            return self._run_highs(time_limit_s, node_limit=node_limit, objective_bound=objective_bound)
        if solver == "CBC":
            return self._solve_pulp(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s))
        raise SolverError(f"unknown solver {solver!r}: use 'HiGHS' or 'CBC'")

    def relaxation(
        self, time_limit_s: float | None = None, ipm: bool = False, status_only: bool = False
    ) -> LpResult:
        """The LP relaxation (every column continuous) by HiGHS: its optimum is a lower bound on
        the program's, and its infeasibility proves the program's. ``ipm``: by the interior point
        method, then crossover to a vertex (the rounding in ``passes/solver.py`` reads the vertex's
        values), where the dual simplex is slow: under memory rows that bind, on the 90,948
        columns of a 2 x 2 mesh of a 2-layer Gemma 2 held to 0.6 of its free plan's peak, 5.3 s
        against 17.5 s; without a binding row the simplex is the faster (a 2-layer Llama's 2 x 2
        mesh, 64,561 columns: 0.2 s against 2.3 s).

        With ``ipm`` the dual simplex still runs first, stopped after ``SIMPLEX_FIRST_WORK`` over
        the matrix's nonzeros iterations (a count of work, not seconds: the same model stops at the
        same place under any load); the interior point method runs only where that did not end in
        an optimum or a proof of infeasibility. Where memory binds on DeepSeek-V3's 3-axis meshes
        on 2,048 H100 (26,000-29,000 columns, 74,000-87,000 nonzeros) the simplex ends in
        2,400-8,600 iterations (at most 7.4e8 of work) and 0.15-0.5 s of CPU against 0.8-1.4 s for
        the interior point method, the same optimum to 1e-9; the 2 x 2 Gemma 2 above (321,585
        nonzeros) took 10 s of simplex to end, so it is stopped early and left to the interior
        point method (benchmarks/README.md, "Where DeepSeek-V3's planning time goes").

        ``status_only`` (with ``ipm``): the caller reads only whether the relaxation is infeasible,
        so the interior point method runs alone, without crossover, and no values are read. The
        iteration cap above bounds the simplex's iterations, not its seconds: on one DeepSeek-V3
        candidate on 1,024 H100 (25,613 columns, coefficients from 1e-9 to 70) the presolved dual
        simplex stalled after 5,185 iterations at some 200 ms each, 689 s before it proved
        infeasibility; the interior point method without crossover proves it in 0.8 s."""
        if ipm and status_only:
            return self._run_highs(time_limit_s, relax=True, ipm=True, crossover=False)
        if ipm:
            iterations = int(SIMPLEX_FIRST_WORK / max(len(self._row_vals), 1))
            got = self._run_highs(time_limit_s, relax=True, iteration_limit=iterations)
            if got.status in ("Optimal", "Infeasible") and not got.time_limited:
                return got
        return self._run_highs(time_limit_s, relax=True, ipm=ipm)

    def integral(self, values: np.ndarray, tol: float = 1e-6) -> bool:
        """Whether ``values`` (a relaxation's solution, which meets every row) are whole on every
        integer column: then they are a solution of the program itself (HiGHS's MIP takes a value
        within 1e-6 of an integer as one)."""
        ints = np.asarray(self.integer, dtype=bool)
        v = values[ints]
        return bool(np.all(np.abs(v - np.round(v)) <= tol))

    def feasible_with(self, fixed: dict[int, float], time_limit_s: float | None = None) -> bool:
        """Whether the program has a solution with the columns ``fixed`` (index -> value) at those
        values: the LP with their bounds pinned (where every integer column is fixed, the rest
        being continuous, a plan of the program itself)."""
        return self._run_highs(time_limit_s, relax=True, fixed=fixed).has_solution

    def first_solution(self, time_limit_s: float | None = None) -> LpResult:
        """Whether the program has a solution (``has_solution``; the values are that solution's,
        the objective is not): HiGHS's branch and bound on its rows alone, without the cost, stopped
        at its first feasible solution. With the cost, HiGHS works its root node on the cost before
        it settles for a first solution: on a 2 x 2 mesh of a 2-layer Llama held to 0.6 of its free
        plan's peak (64,561 columns), 58-102 s where the rows alone take 2.8 s (dev VM)."""
        return self._run_highs(time_limit_s, first=True)

    def _order(self) -> np.ndarray:
        """Column order: by name, as PuLP hands columns to its solvers."""
        return np.array(sorted(range(len(self.names)), key=self.names.__getitem__), dtype=np.int64)

    def _arrays(self) -> tuple:
        """The model as ``Highs.passModel`` takes it (columns in ``_order``, the matrix by
        column), and the order; built once: a model is complete when it is first solved."""
        if self._built is not None:
            return self._built
        n, m = len(self.names), self.num_constraints
        order = self._order()
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)
        # the rows as coordinates, then compressed by column (rows ascending within a column: the
        # matrix PuLP's one-row-at-a-time addRow calls leave HiGHS with)
        counts = np.asarray(self._row_sizes, dtype=np.int64)
        row = np.repeat(np.arange(m, dtype=np.int64), counts)
        col = position[np.asarray(self._row_cols, dtype=np.int64).reshape(row.size)]
        val = np.asarray(self._row_vals, dtype=np.float64).reshape(row.size)
        by_col = np.lexsort((row, col))
        start = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.bincount(col, minlength=n), out=start[1:])
        cost = np.zeros(n)
        for j, c in self.cost.items():
            cost[position[j]] = c
        integer = np.asarray(self.integer, dtype=bool)[order]
        self._built = (
            order, n, m, row.size, self.offset, cost, np.asarray(self.lower)[order],
            np.asarray(self.upper)[order], np.asarray(self.row_lower, dtype=np.float64),
            np.asarray(self.row_upper, dtype=np.float64), start, row[by_col].astype(np.int32), val[by_col],
            integer,
        )  # fmt: skip
        return self._built

    def _run_highs(
        self,
        time_limit_s: float | None,
        relax: bool = False,
        first: bool = False,
        fixed: dict | None = None,
        ipm: bool = False,
        node_limit: int | None = None,
        objective_bound: float | None = None,
        iteration_limit: int | None = None,
        crossover: bool = True,
    ) -> LpResult:
        import highspy

        order, n, m, nz, offset, cost, lower, upper, row_lower, row_upper, start, index, value, integer = (
            self._arrays()
        )
        if fixed:
            position = np.empty(n, dtype=np.int64)
            position[order] = np.arange(n)
            at = position[np.fromiter(fixed, dtype=np.int64, count=len(fixed))]
            pinned = np.fromiter(fixed.values(), dtype=np.float64, count=len(fixed))
            lower, upper = lower.copy(), upper.copy()
            lower[at] = upper[at] = pinned
        kinds = np.where(
            integer & (not relax), int(highspy.HighsVarType.kInteger), int(highspy.HighsVarType.kContinuous)
        ).astype(np.int32)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        if ipm:
            h.setOptionValue("solver", "ipm")
            if not crossover:  # an interior point, not a vertex: for a status
                h.setOptionValue("run_crossover", "off")
        if iteration_limit is not None:  # the simplex's: stopped there, kIterationLimit
            h.setOptionValue("simplex_iteration_limit", int(iteration_limit))
        if node_limit is not None and not relax:
            h.setOptionValue("mip_max_nodes", int(node_limit))
        if objective_bound is not None and not relax:
            h.setOptionValue("objective_bound", float(objective_bound))
        if first:
            h.setOptionValue("mip_max_improving_sols", 1)
            cost = np.zeros_like(cost)
            offset = 0.0
        h.passModel(
            n, m, nz, int(highspy.MatrixFormat.kColwise), int(highspy.ObjSense.kMinimize), offset, cost, lower,
            upper, row_lower, row_upper, start, index, value, kinds,
        )  # fmt: skip
        with owner_idle():  # HiGHS releases the GIL: a search's worker builds tables meanwhile
            h.run()
        values = np.zeros(n)
        col = np.asarray(h.getSolution().col_value, dtype=np.float64)
        if col.size == n:  # none where HiGHS proved the model infeasible before it had columns
            values[order] = col
        objective = h.getObjectiveValue()
        status, has_solution, limited = _highs_status(h.getModelStatus(), objective)
        if iteration_limit is not None and h.getModelStatus() == highspy.HighsModelStatus.kIterationLimit:
            status, has_solution, limited = "Not Solved", False, True  # not an optimum: no bound
        info = h.getInfo()
        cut = h.getModelStatus() == highspy.HighsModelStatus.kSolutionLimit
        if cut and not has_solution:  # stopped at its first solution or node limit: limits PuLP never sets
            has_solution = info.primal_solution_status == highspy.kSolutionStatusFeasible
        if cut and node_limit is not None and not first:
            bound = info.mip_dual_bound
            bound = bound if math.isfinite(bound) else -math.inf
            return LpResult("Optimal" if has_solution else "Not Solved", has_solution, False, values,
                            objective, "HiGHS", node_limited=True, bound=bound)  # fmt: skip
        return LpResult(status, has_solution, limited, values, objective, "HiGHS")

    def _solve_pulp(self, solver) -> LpResult:
        prob = pulp.LpProblem("autopar", pulp.LpMinimize)
        xs = [
            pulp.LpVariable(
                name,
                lowBound=lo if math.isfinite(lo) else None,
                upBound=hi if math.isfinite(hi) else None,
                cat=pulp.LpInteger if integer else pulp.LpContinuous,
            )
            for name, lo, hi, integer in zip(self.names, self.lower, self.upper, self.integer)
        ]
        prob += pulp.LpAffineExpression([(xs[j], c) for j, c in self.cost.items()], constant=self.offset)
        for i, ((ix, cs), lo, hi) in enumerate(zip(self.rows, self.row_lower, self.row_upper)):
            expr = pulp.LpAffineExpression([(xs[j], c) for j, c in zip(ix, cs)])
            if lo == hi:
                prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"r{i}", lo)
            else:
                if math.isfinite(lo):
                    prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"r{i}", lo)
                if math.isfinite(hi):
                    prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"r{i}_le", hi)
        try:
            prob.solve(solver)
        except pulp.PulpSolverError as e:
            raise SolverError(
                f"the ILP solver failed: {e}; check that PuLP's bundled CBC runs on this machine"
            ) from e
        values = np.array([x.value() or 0.0 for x in xs], dtype=np.float64)
        has = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        return LpResult(
            pulp.LpStatus[prob.status],
            has,
            prob.sol_status == pulp.LpSolutionIntegerFeasible,
            values,
            float(pulp.value(prob.objective) or 0.0),
            solver.name,
        )


def _collect(terms: Iterable[Term]) -> tuple[dict[Var, float], float]:
    """Coefficients summed per variable (first-seen order) and the constant: ``1 * coef`` for a
    constant node, nothing for None."""
    constant, coefs = 0.0, {}
    for var, coef in terms:
        if var.__class__ is Var:
            coefs[var] = coefs.get(var, 0.0) + coef
        elif var is not None:
            constant += coef * var
    return coefs, constant


def _highs_status(status, objective: float) -> tuple[str, bool, bool]:
    """(status, has a solution, stopped by a limit) as PuLP's HiGHS interface reads HiGHS's model
    status (``pulp.apis.highs_api.HiGHS.findSolutionValues``): a model without columns is "Not
    Solved", a limit that stopped the search before any solution too."""
    import highspy

    s = highspy.HighsModelStatus
    if status == s.kOptimal:
        return "Optimal", True, False
    if status in (s.kInfeasible, s.kUnboundedOrInfeasible):
        return "Infeasible", False, False
    if status == s.kUnbounded:
        return "Unbounded", False, False
    if status in (s.kObjectiveBound, s.kObjectiveTarget, s.kInterrupt, s.kTimeLimit, s.kIterationLimit):
        if status in (s.kTimeLimit, s.kIterationLimit) and objective == highspy.kHighsInf:
            return "Not Solved", False, False
        return "Optimal", True, True
    return "Not Solved", False, False


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True
