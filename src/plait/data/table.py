"""Tables: `data.name = "table"`, `data.path` = a CSV or Parquet file, `data.target` = the column to predict.

    data.features = ["age", "income"]   # the input columns; [] = every column but the target
    data.task = "auto"                  # classification or regression; auto: regression when the target has
                                        # non-integer numbers, classification for integers or text labels

Features must be numbers; a cell that is not is an error naming the file, the row (the data row, 1 for
the first after the header, with its line in a CSV), the column and the value. Text labels become class
indices in sorted order. Regression trains with the mean squared error (validation reports it as val_loss).
Parquet needs pyarrow (the table extra); CSV is read with Python's csv module.

`data.text_column` makes a text column the input (sentence classification, a BERT fine-tuned on a table):
each text encoded with data.tokenizer to model.context ids (cut texts keep their special tokens) and an
attention mask.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

from plait.data.datasets import split_tensors
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.spec import DataBundle, DataSpec
from plait.errors import ConfigError, DataError
from plait.extras import install_command

SUFFIXES = (".csv", ".parquet", ".pq")


def _cell(text: str) -> int | float | str:
    """A CSV cell as an int, else a float, else the text itself."""
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        return s


def _read_csv(path: Path) -> tuple[list[str], list[list], int]:
    """Header, rows of cells, and the line number of the first data row."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise DataError(f"{path} is empty; a table needs a header row and data rows") from None
        rows = []
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(f"{path}: row {len(rows) + 1} (line {line}) has {len(row)} cells but the header has "
                                f"{len(header)} columns; fix that row")
            rows.append([_cell(c) for c in row])
    return header, rows, 2


def _read_parquet(path: Path) -> tuple[list[str], list[list], int]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data.path = {str(path)!r} is Parquet, which plait reads with pyarrow: "
                          f"{install_command('table')}") from None
    try:
        data = pq.read_table(path).to_pydict()
    except Exception as e:  # pyarrow's own error types for files that are not Parquet
        raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    header = list(data)
    rows = [list(r) for r in zip(*data.values())] if header else []
    return header, rows, 0


def read_table(path: Path) -> tuple[list[str], list[list], int]:
    """(columns, rows, line of the first data row; 0 where rows have no lines) of a CSV or Parquet file."""
    if not path.is_file():
        raise DataError(f"data.path = {str(path)!r} does not exist; set it to a .csv or .parquet file")
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(f"data.path = {str(path)!r}: unsupported suffix {path.suffix!r} for data.name = 'table'; use "
                        f"{', '.join(SUFFIXES)}")
    header, rows, first_line = _read_parquet(path) if path.suffix.lower() != ".csv" else _read_csv(path)
    if not rows:
        raise DataError(f"{path} has no data rows")
    return header, rows, first_line


def _where(path: Path, r: int, first_line: int) -> str:
    return f"{path}: row {r + 1}" + (f" (line {first_line + r})" if first_line else "")


def _number(value, path: Path, r: int, first_line: int, column: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        what = "is empty" if value is None or value == "" else f"{value!r} is not a finite number"
        raise DataError(f"{_where(path, r, first_line)}, column {column!r}: {what}; fix the cell or leave the column "
                        "out of data.features")
    return float(value)


def table_source(data_cfg, model_cfg):
    """data.name = "table": numeric feature columns -> a target column, split like the other in-memory sources."""
    if not data_cfg.target:
        raise ConfigError("data.name = 'table' needs data.target = the column to predict; set --set data.target=NAME")
    path = Path(data_cfg.path)
    header, rows, first_line = read_table(path)
    if data_cfg.target not in header:
        raise DataError(f"{path} has no column {data_cfg.target!r} (data.target); its columns: {', '.join(header)}")
    if data_cfg.text_column:
        return _text_table(data_cfg, model_cfg, path, header, rows)
    features = list(data_cfg.features) or [c for c in header if c != data_cfg.target]
    missing = [c for c in features if c not in header]
    if missing or not features or data_cfg.target in features:
        why = (f"has no column(s) {missing}" if missing else "leaves no feature column" if not features
               else f"lists the target {data_cfg.target!r} as a feature")
        raise DataError(f"data.features = {features} {why} in {path}; its columns: {', '.join(header)}")
    cols = [header.index(c) for c in features]
    x = torch.tensor([[_number(row[c], path, r, first_line, header[c]) for c in cols] for r, row in enumerate(rows)],
                     dtype=torch.float32)
    task, y, classes = _targets(data_cfg, path, header, rows, first_line)
    spec = DataSpec(name="table", task=task, input_shape=[len(cols)], num_classes=classes)
    train, val = split_tensors("table", x, y, data_cfg.val_fraction)
    return DataBundle(train, val, spec)


def _targets(data_cfg, path: Path, header: list[str], rows: list[list], first_line: int):
    """(task, target tensor, classes: 1 for regression)."""
    t = header.index(data_cfg.target)
    targets = [row[t] for row in rows]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in targets)
    task = data_cfg.task
    if task == "auto":
        task = "regression" if numeric and not all(isinstance(v, int) for v in targets) else "classification"
    if task == "regression":
        return task, torch.tensor([_number(v, path, r, first_line, data_cfg.target) for r, v in enumerate(targets)]), 1
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in targets):
        y = torch.tensor(targets, dtype=torch.long)
    else:  # text labels (or negative, non-integer numbers named as classes): indices in sorted order
        classes = sorted({str(v) for v in targets})
        y = torch.tensor([classes.index(str(v)) for v in targets], dtype=torch.long)
    return task, y, int(y.max()) + 1


def _text_table(data_cfg, model_cfg, path: Path, header: list[str], rows: list[list]) -> DataBundle:
    """data.text_column: each row's text encoded with data.tokenizer (its special tokens, e.g. [CLS] ... [SEP]) to
    model.context ids, then its attention mask (1 real, 0 padding): inputs (rows, 2, context)."""
    column = data_cfg.text_column
    if column not in header:
        raise DataError(f"{path} has no column {column!r} (data.text_column); its columns: {', '.join(header)}")
    if data_cfg.features:
        raise ConfigError(f"data.text_column = {column!r} is the input; data.features = {list(data_cfg.features)} would "
                          "be another: leave data.features empty")
    if not data_cfg.tokenizer:
        raise ConfigError(f"data.text_column = {column!r} is encoded with data.tokenizer; set it to a Hugging Face "
                          "tokenizer.json (a train.init_from directory with one sets it)")
    task, y, classes = _targets(data_cfg, path, header, rows, 0)
    if task != "classification":
        raise ConfigError(f"data.text_column classifies texts, but data.target = {data_cfg.target!r} holds non-integer "
                          "numbers (a regression); give class labels or set data.task='classification'")
    tok = HFTokenizer.from_file(data_cfg.tokenizer).tokenizer
    context = model_cfg.context
    pad = next((i for i in (tok.token_to_id(t) for t in ("[PAD]", "<pad>", "<|pad|>")) if i is not None), 0)
    c = header.index(column)
    x = torch.full((len(rows), 2, context), 0, dtype=torch.long)
    x[:, 0] = pad
    cut = 0
    tok.no_padding()
    tok.enable_truncation(max_length=context)  # the text is cut, its special tokens ([SEP]) kept
    for r, row in enumerate(rows):
        enc = tok.encode(str(row[c]))
        cut += bool(enc.overflowing)
        ids = enc.ids
        x[r, 0, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        x[r, 1, :len(ids)] = 1
    spec = DataSpec(name="table", task="classification", input_shape=[2, context], num_classes=classes,
                    vocab_size=tok.get_vocab_size(with_added_tokens=True))
    train, val = split_tensors("table", x, y, data_cfg.val_fraction)
    return DataBundle(train, val, spec, stats={"examples": len(rows), "truncated": cut,
                                                         "limit_tokens": context})
