"""The prompts a job trains on: loaded from its dataset (or generated for its task) once, and
kept by the leader while the job runs."""

from __future__ import annotations

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.jobspec import JobSpec
from robustrl.generation.tasks import Columns, TaskItem, UnknownTaskError, get_task, load_rows


def dataset_for(spec: JobSpec) -> list[TaskItem]:
    """The job's training items; InvalidArgument naming the field (and the file, row and
    column) when they cannot be had."""
    try:
        task = get_task(spec.task.name)
    except UnknownTaskError as exc:
        raise InvalidArgument(f"task.name: {exc}") from exc
    if not task.generated and not spec.task.eval_dataset:
        raise InvalidArgument(
            f"task.eval_dataset: the {task.name} task has no built-in held-out rows; "
            "name a file of them"
        )
    if spec.task.dataset:
        columns = Columns(spec.task.prompt_column, spec.task.answer_column)
        return load_rows("task.dataset", spec.task.dataset, columns)
    if not task.generated:
        raise InvalidArgument(f"task.dataset: the {task.name} task trains on a dataset; name it")
    # Sized by the planned steps, not the budget: an update of the budget must not change
    # which item a group index maps to (a leader after a failover loads the data again).
    size = max(1024, 2 * spec.trainer.planned_steps * spec.trainer.groups_per_step)
    return task.generate(size, spec.seed)


class Datasets:
    """Each running job's items, loaded at its start or, after a failover, at its first lease."""

    def __init__(self) -> None:
        self._items: dict[str, list[TaskItem]] = {}

    def of(self, job_id: str, spec: JobSpec) -> list[TaskItem]:
        items = self._items.get(job_id) or dataset_for(spec)
        self._items[job_id] = items
        return items

    def keep(self, job_id: str, items: list[TaskItem]) -> None:
        self._items[job_id] = items

    def forget(self, job_id: str) -> None:
        self._items.pop(job_id, None)
