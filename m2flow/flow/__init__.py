"""How a workflow executes: the Plan every runner consumes."""

from m2flow.flow.plan import MODES, ComponentPlan, Plan, PlanError, Workflow

__all__ = ["MODES", "ComponentPlan", "Plan", "PlanError", "Workflow"]
