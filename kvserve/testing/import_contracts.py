"""An import-linter contract type the built-in ones lack: an allowlist (`type = "allowlist"`).

A `forbidden` contract lists what a package may not import, so a new dependency slips through
until someone thinks to list it. `AllowlistContract` inverts that: every module a source package
imports directly must be the package itself, on `allowed_modules` (or below one), or in the
standard library less `forbidden_stdlib`. The scheduling core is held to one
(`[tool.importlinter]` in pyproject.toml).
"""

from __future__ import annotations

import sys
from typing import Any, cast

from importlinter import Contract, ContractCheck, fields, output


class AllowlistContract(Contract):
    type_name = "allowlist"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())
    forbidden_stdlib = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        violations = []
        for source in cast(list[str], self.source_modules):
            for importer in sorted({source} | graph.find_descendants(source)):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    if not self._allowed(imported, source):
                        details = graph.get_import_details(importer=importer, imported=imported)
                        lines = sorted(d["line_number"] for d in details)
                        violations.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def _allowed(self, imported: str, source: str) -> bool:
        if imported == source or imported.startswith(source + "."):
            return True
        top = imported.split(".", maxsplit=1)[0]
        if top in sys.stdlib_module_names:
            return top not in cast(list[str], self.forbidden_stdlib)
        return any(imported == a or imported.startswith(a + ".") for a in cast(list[str], self.allowed_modules))

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            lines = ", ".join(f"l.{n}" for n in violation["lines"])
            output.print_error(f"{violation['importer']} -> {violation['imported']} ({lines}): not on the allowlist")
            output.new_line()
