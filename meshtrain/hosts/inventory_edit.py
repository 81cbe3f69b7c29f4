"""Set hosts' ``python:``, and record their chosen links, in an inventory file without
disturbing the rest of it (:func:`set_python`, :func:`set_links`).

Only the characters of existing ``python:`` values change: their exact place comes
from the YAML parser's marks, so comments, order, quoting and layout stay as the user
wrote them. Hosts that take ``python`` from ``defaults`` are changed there when they all
want the same value. A change that needs a new key (a host that must differ from
the defaults) is not made: the caller tells the user what to set. The edited text is
parsed again and must give exactly the wanted interpreters and nothing else changed,
before it replaces the file atomically.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from meshtrain import yaml12
from meshtrain.hosts.inventory import Inventory, InventoryError, parse_inventory
from meshtrain.run_dir import atomic_write

_PLAIN = re.compile(r"^[A-Za-z0-9_./~+@-]+$")


@dataclass
class InventoryEdit:
    """What :func:`set_python` did: whether the file was written, and what is left to do by hand."""

    written: bool = False
    changed: list[str] = field(default_factory=list)  # host names whose python now differs
    by_hand: list[str] = field(default_factory=list)  # "host NAME: set python: VALUE" lines


def set_python(path: Path, wanted: dict[str, str], *, write: bool = True) -> InventoryEdit:
    """Make host ``name``'s interpreter ``wanted[name]`` in the inventory at ``path``."""
    text = path.read_text()
    inventory = parse_inventory(yaml12.load(text), path)
    current = {h.name: h.python for h in inventory.hosts}
    edit = InventoryEdit(changed=[n for n, v in wanted.items() if current.get(n) != v])
    if not edit.changed:
        return edit
    root = yaml.compose(text)
    defaults_node = _value(root, "defaults")
    defaults_python = _value(defaults_node, "python") if defaults_node is not None else None
    own: dict[str, yaml.Node | None] = {}
    hosts_node = _value(root, "hosts")
    for entry in hosts_node.value if isinstance(hosts_node, yaml.SequenceNode) else []:
        name = _value(entry, "name")
        if isinstance(name, yaml.ScalarNode):
            own[name.value] = _value(entry, "python")
    plan: list[tuple[str, yaml.ScalarNode, str]] = []  # (where, value node, new value)
    inheriting = [h.name for h in inventory.hosts if own.get(h.name) is None]
    for name in edit.changed:
        node = own.get(name)
        if node is not None:
            plan.append((f"host {name}", node, wanted[name]))
    if any(n in edit.changed for n in inheriting):
        values = {wanted.get(n, current[n]) for n in inheriting}
        if len(values) == 1 and isinstance(defaults_python, yaml.ScalarNode):
            plan.append(("defaults", defaults_python, values.pop()))
        else:
            edit.by_hand += [f"host {n}: set python: {wanted[n]}" for n in inheriting if n in edit.changed]
    if edit.by_hand or not write:
        edit.by_hand += [f"{where}: set python: {value}" for where, _, value in plan]
        return edit
    new_text = text
    for _, node, value in sorted(plan, key=lambda p: p[1].start_mark.index, reverse=True):
        start, end = node.start_mark.index, node.end_mark.index
        new_text = new_text[:start] + _scalar(value, node.style) + new_text[end:]
    if not _only_python_changed(inventory, new_text, path, wanted):
        edit.by_hand = [f"host {n}: set python: {wanted[n]}" for n in edit.changed]
        return edit
    _replace_keeping_mode(path, new_text)
    edit.written = True
    return edit


def _value(mapping: yaml.Node | None, key: str) -> yaml.Node | None:
    if not isinstance(mapping, yaml.MappingNode):
        return None
    for k, v in mapping.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    return None


def _scalar(value: str, style: str | None) -> str:
    """``value`` written in the original's quoting style where that is safe."""
    if style == "'" and "'" not in value:
        return f"'{value}'"
    if style is None and _PLAIN.match(value) and value != "~":
        return value
    return json.dumps(value)  # a JSON string is a valid double-quoted YAML scalar


def _only_python_changed(before: Inventory, new_text: str, path: Path, wanted: dict[str, str]) -> bool:
    """The edited text parses to the same inventory with the wanted interpreters."""
    try:
        after = parse_inventory(yaml12.load(new_text), path)
    except (yaml.YAMLError, InventoryError):
        return False
    expected = tuple(dataclasses.replace(h, python=wanted.get(h.name, h.python)) for h in before.hosts)
    return after.hosts == expected and after.rendezvous == before.rendezvous


def set_links(path: Path, links: dict[str, tuple[str, str, float]]) -> bool:
    """Make host ``name`` use ``links[name] = (address, iface, bandwidth)``: its ``advertise``
    and ``iface`` keys become the chosen link's, ``link_bandwidth`` records what was
    measured. Returns whether the file changed.

    Only those keys of those hosts change, in the text as the user wrote it: a key the host
    has gets its value replaced in place (the comment after it stays), a key it lacks is a new
    line right after the host's ``name:`` line, at its keys' indentation (inside the braces
    for a host written as ``{name: ..., host: ...}``). Comments, blank lines, order and quoting
    stay. The edited text must parse to the same inventory with only those keys changed, and
    replaces the file atomically with its mode kept."""
    text = path.read_text()
    before = parse_inventory(yaml12.load(text), path)
    expected = tuple(dataclasses.replace(h, advertise=links[h.name][0], iface=links[h.name][1],
                                         link_bandwidth=float(f"{links[h.name][2]:.4g}"))
                     if h.name in links else h for h in before.hosts)
    if expected == before.hosts:
        return False
    edits: list[tuple[int, int, str]] = []  # (start, end, new text) of the original text
    hosts_node = _value(yaml.compose(text), "hosts")
    for entry in hosts_node.value if isinstance(hosts_node, yaml.SequenceNode) else []:
        name = _value(entry, "name")
        if not (isinstance(entry, yaml.MappingNode) and isinstance(name, yaml.ScalarNode)
                and name.value in links):
            continue
        address, iface, bandwidth = links[name.value]
        values = {"advertise": _string(address), "iface": _string(iface),
                  "link_bandwidth": _float(float(f"{bandwidth:.4g}"))}
        added = []
        for key, value in values.items():
            node = _value(entry, key)
            if isinstance(node, yaml.ScalarNode):
                edits.append((node.start_mark.index, node.end_mark.index, value))
            else:
                added.append((key, value))
        if added and entry.flow_style:
            end = entry.end_mark.index - 1  # the closing brace
            edits.append((end, end, "".join(f", {k}: {v}" for k, v in added)))
        elif added:
            # After the name's line: a single-line scalar (a host name), so the line that
            # holds its end is the whole key, whatever follows the host (nested mappings).
            line_end = text.find("\n", name.end_mark.index)
            at = len(text) if line_end < 0 else line_end + 1
            indent = " " * entry.value[0][0].start_mark.column
            lines = "".join(f"{indent}{k}: {v}\n" for k, v in added)
            edits.append((at, at, lines if line_end >= 0 else "\n" + lines))
    new_text = text
    for start, end, value in sorted(edits, reverse=True):
        new_text = new_text[:start] + value + new_text[end:]
    try:
        after = parse_inventory(yaml12.load(new_text), path)
    except (yaml.YAMLError, InventoryError) as exc:
        raise InventoryError(f"{path}: recording the chosen links would make the file unreadable "
                             f"({exc}); set advertise, iface and link_bandwidth by hand") from exc
    if after.hosts != expected or after.rendezvous != before.rendezvous:
        raise InventoryError(f"{path}: recording the chosen links would change more than the "
                             "hosts' advertise, iface and link_bandwidth")
    _replace_keeping_mode(path, new_text)
    return True


def _string(value: str) -> str:
    """``value`` as a YAML scalar that reads back as that string: plain where it can be."""
    if _PLAIN.match(value) and yaml12.load(f"k: {value}") == {"k": value}:
        return value
    return json.dumps(value)


def _float(value: float) -> str:
    """``value`` as a YAML scalar that every YAML reader takes for a float (a dot in it)."""
    mantissa, _, exponent = repr(value).partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + (f"e{exponent}" if exponent else "")


def _replace_keeping_mode(path: Path, text: str) -> None:
    """Replace the file atomically with ``text``, its mode kept (a new file would get the umask's)."""
    mode = path.stat().st_mode & 0o777

    def write_with_mode(tmp: Path) -> None:
        tmp.write_text(text)
        tmp.chmod(mode)

    atomic_write(path, write_with_mode)
