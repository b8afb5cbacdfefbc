"""Client SDK: `Workflow` / `WorkflowRun` / `Agent` attach kvflow metadata to OpenAI SDK calls."""

from kvflow_ray.client.workflow import Agent, Workflow, WorkflowRun

__all__ = ["Agent", "Workflow", "WorkflowRun"]
