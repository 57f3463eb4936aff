# Sourced by the device scripts: unpack the stripped Triton 3.9 of .t39/ (scripts/gpu_triton39.sh's header says how it
# is built) into /tmp/t39, once per machine, and check that it can compile for sm_90 (its ptxas-blackwell).
B=/tmp/t39/triton/backends/nvidia/bin
if [[ -f .t39/a && ! -x $B/ptxas-blackwell ]]; then
  rm -rf /tmp/t39 && mkdir -p /tmp/t39 && xz -dc .t39/b | tar -C /tmp/t39 -xf - && xz -dc .t39/a > /tmp/t39/triton/_C/libtriton.so
  # (a wheel unpacked by zipfile keeps no mode bits: without this, every 3.9 compile fails "Permission denied")
  chmod +x $B/*
  [[ -e $B/ptxas ]] || ln -s ptxas-blackwell $B/ptxas  # (arch < 90 only; not carried)
fi
if [[ -f .t39/a ]]; then "$B/ptxas-blackwell" --version | tail -1 || echo "warning: Triton 3.9's ptxas-blackwell does not run"; fi
