# What the guest scripts share; sourced from the repository root after setting GUEST_SCRIPT
# (the name messages start with) and GUEST_WHAT (what is skipped when no guest can run).

say() { printf '%s: %s\n' "$GUEST_SCRIPT" "$*" >&2; }

# No guest here: with CI=true that is a failure, otherwise the tests are skipped, saying why.
unavailable() {
  if [ "${CI:-}" = true ]; then
    say "error: $*"
    exit 1
  fi
  say "skipping the $GUEST_WHAT: $*"
  exit 0
}

# The guest kernel: $KVTIER_GUEST_KERNEL, else the one tools/guest/setup.sh prepares (empty if
# it cannot).
guest_kernel() {
  if [ -n "${KVTIER_GUEST_KERNEL:-}" ]; then
    printf '%s\n' "$KVTIER_GUEST_KERNEL"
  else
    tools/guest/setup.sh 2>/dev/null | sed -n 's/^KVTIER_GUEST_KERNEL=//p' | tail -1 || true
  fi
}

# QEMU and a guest kernel, or `unavailable`; sets `kernel`.
require_guest() {
  command -v qemu-system-x86_64 >/dev/null 2>&1 \
    || unavailable "qemu-system-x86_64 is not installed (tools/guest/setup.sh installs it)"
  kernel=$(guest_kernel)
  [ -n "$kernel" ] && [ -f "$kernel" ] || unavailable "no guest kernel (run tools/guest/setup.sh)"
}

# "name path" of each test binary named, from the build `cargo test --workspace --all-targets
# --features kvtier/sim` made (the same flags, so nothing is rebuilt).
test_binaries() {
  cargo test --workspace --all-targets --locked --features kvtier/sim --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
names = set(sys.argv[1:])
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    name = m.get("target", {}).get("name")
    if m.get("reason") == "compiler-artifact" and exe and name in names:
        print(name, exe)
' "$@"
}

# Boots one round: tools/guest/run.sh with the arguments after the round's name and its console
# log; returns run.sh's status. A round the emulator failed (run.sh's status 123: a guest kernel
# left without its timer interrupts, or QEMU aborting on its own assertion) is booted again,
# saying so, up to three boots in all; any other failure is final, a hang at --timeout included.
# The console log (and so the test lines the suite counts) is the last boot's.
boot_round() {
  local name=$1 log=$2
  shift 2
  local boot rc
  for boot in 1 2 3; do
    rc=0
    tools/guest/run.sh --log "$log" "$@" >/dev/null 2>&1 || rc=$?
    [ "$rc" -eq 123 ] && [ "$boot" -lt 3 ] || break
    say "round $name: boot $boot: the emulator failed (not a test); the console said:"
    grep -a -m1 -E "timer wakeup didn't happen|^qemu-system-x86_64: .*Assertion" "$log" >&2 || true
    say "round $name: booting it again"
  done
  return "$rc"
}
