"""KServe's own Python model server (`kserve` on PyPI) serving a small DLRM: the third-party Open Inference
Protocol server that tests/test_serve.py drives with `infer run --target kserve://...`.

Run by the kserve environment's python (kserve needs protobuf < 7, so it lives in a cached venv of its own,
without torch): the model is the lab's, its weights exported to an .npz, its forward written here in numpy.
A model named `*-short` answers one score fewer than asked: a bad answer.
"""

import sys

import kserve
import numpy as np
from kserve import InferOutput, InferRequest, InferResponse


class DLRM(kserve.Model):
    """A DLRM forward in numpy from the lab model's weights: bottom MLP (ReLU), sum-pooled tables,
    the dot interaction's upper triangle, top MLP (ReLU, last layer linear), sigmoid."""

    def __init__(self, name, weights):
        super().__init__(name)
        w = np.load(weights)
        self.bottom = [(w[f"bottom_w{i}"], w[f"bottom_b{i}"]) for i in range(int(w["n_bottom"]))]
        self.top = [(w[f"top_w{i}"], w[f"top_b{i}"]) for i in range(int(w["n_top"]))]
        self.tables = [w[f"table_{f}"] for f in range(int(w["n_tables"]))]
        self.num_dense = self.bottom[0][0].shape[1]
        self.ready = True

    def get_input_types(self):
        f = len(self.tables)
        return [
            {"name": "dense", "datatype": "FP32", "shape": [-1, self.num_dense]},
            {"name": "lengths", "datatype": "INT32", "shape": [f, -1]},
            {"name": "ids", "datatype": "INT64", "shape": [-1]},
        ]

    def get_output_types(self):
        return [{"name": "scores", "datatype": "FP32", "shape": [-1]}]

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        x = {i.name: i.as_numpy() for i in payload.inputs}
        dense, lengths, ids = x["dense"].astype(np.float32), x["lengths"], x["ids"]
        n, h = dense.shape[0], dense
        for wt, b in self.bottom:
            h = np.maximum(h @ wt.T + b, 0)
        pooled, at = [], 0
        for f, table in enumerate(self.tables):
            counts = lengths[f]
            rows = table[ids[at : at + counts.sum()]]
            at += counts.sum()
            bag = np.repeat(np.arange(n), counts)
            out = np.zeros((n, table.shape[1]), dtype=np.float32)
            np.add.at(out, bag, rows)
            pooled.append(out)
        combined = np.stack([h, *pooled], axis=1)
        gram = combined @ combined.transpose(0, 2, 1)
        r, c = np.triu_indices(combined.shape[1], k=1)
        z = np.concatenate([h, gram[:, r, c]], axis=1)
        for k, (wt, b) in enumerate(self.top):
            z = z @ wt.T + b
            if k < len(self.top) - 1:
                z = np.maximum(z, 0)
        scores = (1 / (1 + np.exp(-z[:, 0]))).astype(np.float32)
        if self.name.endswith("-short"):
            scores = scores[:-1]
        out = InferOutput(name="scores", shape=[len(scores)], datatype="FP32")
        out.set_data_from_numpy(scores, binary_data=False)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=[out])


if __name__ == "__main__":  # name, weights (.npz), gRPC port, HTTP port
    name, weights, grpc_port, http_port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    models = [DLRM(name, weights), DLRM(f"{name}-short", weights)]
    kserve.ModelServer(grpc_port=grpc_port, http_port=http_port, enable_grpc=True, workers=1).start(models)
