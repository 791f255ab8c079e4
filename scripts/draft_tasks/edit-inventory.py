"""Inventory of a small shop: items, stock levels and reorders."""

from dataclasses import dataclass


@dataclass
class Item:
    name: str
    stock: int
    reorder_level: int
    price: float


def load_items(rows):
    items = []
    for row in rows:
        name, stock, level, price = row.split(",")
        items.append(Item(name.strip(), int(stock), int(level), float(price)))
    return items


def needs_reorder(items):
    return [item for item in items if item.stock <= item.reorder_level]


def stock_value(items):
    total = 0.0
    for item in items:
        total += item.stock * item.price
    return round(total, 2)


def report(items):
    lines = []
    for item in needs_reorder(items):
        lines.append(f"{item.name}: {item.stock} left, reorder at {item.reorder_level}")
    lines.append(f"stock value: {stock_value(items)}")
    return "\n".join(lines)
