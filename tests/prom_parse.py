"""Parses Prometheus text from stdin with the official client's parser
(prometheus_client.parser) and prints the families as JSON: a list of
{"name", "type", "samples": [{"name", "labels", "value"}]}. A malformed
exposition raises, and the test that runs this fails."""
import json
import math
import sys

from prometheus_client.parser import text_string_to_metric_families

out = []
for fam in text_string_to_metric_families(sys.stdin.read()):
    samples = []
    for s in fam.samples:
        v = s.value
        samples.append({"name": s.name, "labels": dict(s.labels), "value": "+Inf" if math.isinf(v) else v})
    out.append({"name": fam.name, "type": fam.type, "samples": samples})
json.dump(out, sys.stdout)
