"""W&B logging of a run (offline by default; online when the user sets a project and mode)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Tracker:
    """One W&B run per post-training run; resumes the same W&B run id on a resumed run."""

    def __init__(self, run_dir: Path, project: str, mode: str, entity: str | None, config: dict[str, Any]) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, entity=entity, mode=mode, dir=str(run_dir), id=run_id,
                              resume="allow", config=config, reinit="finish_previous")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def alert(self, title: str, text: str) -> None:
        logger.warning("%s: %s", title, text)
        try:
            self.run.alert(title=title, text=text)
        except Exception as exc:  # offline runs cannot send alerts; the warning above stands
            logger.debug("W&B alert not sent: %s", exc)

    @property
    def files_dir(self) -> str:
        return str(Path(self.run.dir).parent)

    def finish(self) -> None:
        self.run.finish()
