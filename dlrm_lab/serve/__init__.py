"""Client/server inference over gRPC (docs/serving.md).

    dlrm-lab client workers (processes) -- RemoteServer.submit -> gRPC Infer --> server.InferenceService
        -> the inference lab's InferenceServer (dynamic batcher, co-located instances)

`protocol` holds the wire format (inference.proto, its generated modules and the packed
payload), `server` the gRPC front of an InferenceServer (`open_inference` its Open Inference Protocol, `rest` the
same over HTTP/REST, both checking tensors by `v2_tensors`), `remote` the system under test as
a client sees it (an `infer.sut.SystemUnderTest`: the lab's drivers drive it unchanged), `client` the concurrent client
workers and their run directory, `records` the client's per-query rows and summary.
"""
