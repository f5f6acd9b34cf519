"""Typer command groups behind `service.cli`; heavy imports stay inside the command bodies."""
