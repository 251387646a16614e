"""What the workloads measure of the machine, under Debian's /usr/bin/python3 (no psutil
there): the CPU time of all cores, busy and idle."""
import os


def cpu_times() -> tuple[float, float]:
    """(busy, idle) seconds of all CPUs since boot, from /proc/stat (I/O wait counts as
    idle; guest time is inside user and nice already)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (idle + iowait) / tick
