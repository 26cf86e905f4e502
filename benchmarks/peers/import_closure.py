"""Static closure of module-level imports, for checking what a peer bundle lacks (no import runs).

    python3 benchmarks/peers/import_closure.py SITE sglang.launch_server,sglang.srt.entrypoints.http_server sglang,sgl_kernel,flashinfer

SITE is an unpacked bundle (/tmp/sgsite).  Follows every module-level import (both branches of
every `if`, except TYPE_CHECKING; try bodies and handlers, reported as optional) of the modules in
the listed packages that SITE holds; prints the top-level names imported from elsewhere.  Imports
inside functions (lazy) are not followed.  An over-approximation of one launch's imports.
"""
import ast, os, sys, json
SITE = sys.argv[1]; entries = sys.argv[2].split(","); follow_pkgs = set(sys.argv[3].split(","))
def mod_path(mod):
    base = os.path.join(SITE, *mod.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(p): return p
    return None
seen, ext_req, ext_opt, where = set(), {}, {}, {}
stack = list(entries)
def resolve(cur, node):
    is_pkg = mod_path(cur) and mod_path(cur).endswith("__init__.py")
    if isinstance(node, ast.ImportFrom) and node.level:
        parts = cur.split(".")
        if not is_pkg: parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        base = ".".join(parts + ([node.module] if node.module else []))
    elif isinstance(node, ast.ImportFrom):
        base = node.module
    out = []
    if isinstance(node, ast.Import):
        out = [a.name for a in node.names]
    else:
        out.append(base)
        for a in node.names:
            if a.name != "*": out.append(base + "." + a.name)
    return out
def walk(body, cur, optional, out):
    for n in body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            for m in resolve(cur, n): out.append((m, optional))
        elif isinstance(n, ast.Try):
            walk(n.body, cur, True, out)
            for h in n.handlers: walk(h.body, cur, True, out)
            walk(n.orelse, cur, optional, out); walk(n.finalbody, cur, optional, out)
        elif isinstance(n, ast.If):
            # TYPE_CHECKING blocks are skipped
            t = ast.unparse(n.test)
            if "TYPE_CHECKING" in t: continue
            walk(n.body, cur, True, out); walk(n.orelse, cur, True, out)
        elif isinstance(n, (ast.With,)):
            walk(n.body, cur, optional, out)
while stack:
    cur = stack.pop()
    if cur in seen: continue
    seen.add(cur)
    p = mod_path(cur)
    if not p: continue
    # importing a.b.c imports a and a.b first
    parts = cur.split(".")
    for i in range(1, len(parts)):
        stack.append(".".join(parts[:i]))
    try: tree = ast.parse(open(p, encoding="utf-8").read())
    except Exception as e: print("PARSE FAIL", p, e, file=sys.stderr); continue
    out = []; walk(tree.body, cur, False, out)
    for m, opt in out:
        top = m.split(".")[0]
        if top in follow_pkgs or (mod_path(m) and top in follow_pkgs):
            if mod_path(m): stack.append(m)
        else:
            d = ext_opt if opt else ext_req
            d.setdefault(top, set()).add(cur)
print(json.dumps({"modules_followed": len(seen),
  "required": {k: sorted(v)[:3] for k, v in sorted(ext_req.items())},
  "optional_only": {k: sorted(v)[:3] for k, v in sorted(ext_opt.items()) if k not in ext_req}}, indent=1))
