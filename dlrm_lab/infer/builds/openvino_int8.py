"""`openvino_int8`: the `openvino` build with its dense part quantised to int8 by NNCF, OpenVINO's own quantiser.

Static post-training quantisation (NNCF's default preset: int8 weights per channel, activations per tensor),
calibrated on the same samples of the preset's own data as `aoti_int8`, kept in the same content-keyed cache (its
key naming NNCF's version and the calibration). The CPU plugin runs the int8 matrix products with AMX or VNNI and
quantises the activations inside its kernels, where the PT2E packages of `aoti_int8` dequantise per call on this
stack. Needs the `openvino` extra (OpenVINO and NNCF).
"""

from __future__ import annotations

from dlrm_lab.infer.builds.openvino import OpenVINOBuild


class OpenVINOInt8Build(OpenVINOBuild):
    """`openvino` with its dense part quantised to int8 by NNCF (OpenVINO's own quantiser): the CPU plugin runs the
    int8 matrix products with AMX or VNNI and keeps the activations' quantisation inside its kernels."""

    name = "openvino_int8"
    order = 9
    about = "openvino, its dense part int8 (NNCF post-training quantisation, calibrated), run by the CPU plugin"
    dense_precision = "int8"  # judged by the reduced-precision rule (infer.accuracy), never fp32's exact one
    weight_precision = "int8"
    quantise = True


BUILD = OpenVINOInt8Build()
