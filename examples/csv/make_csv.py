"""Writes a small CSV with numeric and text columns, and gaps: will someone carry an umbrella?

    python make_csv.py [--out data/weather.csv] [--rows 2000] [--gaps 0.03]

Columns: temperature (decimal), humidity (whole number), sky (clear, cloudy, rain: a category) and the label
umbrella (yes, no): yes when it rains, or when it is cloudy and humid. A share `--gaps` of the cells is left
empty or `NA`, as real tables have them. Offline: numpy makes the rows.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/weather.csv"))
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--gaps", type=float, default=0.03, help="the share of cells left missing")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["temperature", "humidity", "sky", "umbrella"])
        for _ in range(args.rows):
            sky = rng.choice(["clear", "cloudy", "rain"])
            humidity = int(rng.integers(20, 100))
            umbrella = sky == "rain" or (sky == "cloudy" and humidity > 70)
            row = [f"{rng.normal(15, 8):.1f}", humidity, sky, "yes" if umbrella else "no"]
            writer.writerow([rng.choice(["", "NA"]) if rng.random() < args.gaps else cell for cell in row])
    print(f"{args.out}: {args.rows} rows")


if __name__ == "__main__":
    main()
