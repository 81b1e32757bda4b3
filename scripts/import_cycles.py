"""Lists import cycles between specd's modules; exit status 1 if there is one.

Every import statement counts: module level, inside a function, and under
``if TYPE_CHECKING:`` (grimp reads them all), so a cycle a reader has to hold in mind is
listed even when Python would never import it at run time. A cycle is a strongly connected
component of the module graph (Tarjan's algorithm); each is printed with the imports that
make it, ``importer -> imported (line)``.

    python scripts/import_cycles.py            # specd's five packages
    python scripts/import_cycles.py coordinator

``tests/test_import_cycles.py`` runs it; import-linter's contracts (pyproject,
``lint-imports``) state the order of packages and rooms, this the absence of any cycle.
"""

from __future__ import annotations

import sys

import grimp

#: The project's packages (pyproject's ``[tool.importlinter]`` root packages).
PACKAGES = ("specd_core", "target_worker", "drafter_worker", "coordinator", "specd_tools")


def find_cycles(packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """The import cycles among the modules of ``packages``: each a sorted list of module
    names (a strongly connected component of two or more modules, or a module importing
    itself), the list sorted."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False, cache_dir=None)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in modules:  # iterative Tarjan: the graph is deep enough for recursion limits
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))
    return sorted(found)


def describe(cycle: list[str], packages: tuple[str, ...] = PACKAGES) -> str:
    """The imports between the modules of ``cycle``, one per line."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False, cache_dir=None)
    members = set(cycle)
    lines = []
    for importer in cycle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            where = ", ".join(str(d["line_number"]) for d in details)
            lines.append(f"  {importer} -> {imported} (line {where})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    packages = tuple(argv) or PACKAGES
    cycles = find_cycles(packages)
    for cycle in cycles:
        print(f"cycle of {len(cycle)} modules:\n{describe(cycle, packages)}")
    print(f"{len(cycles)} import cycle(s) in {', '.join(packages)}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
