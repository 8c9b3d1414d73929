/* The host around the GPUs, read from sysfs: how many GPUs share it, which NUMA node each sits on. */
#include "platform/topology.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PCI_VENDOR_NVIDIA 0x10de
#define PCI_VENDOR_AMD 0x1002
#define PCI_CLASS_DISPLAY 0x03       /* VGA and 3D controllers: every NVIDIA data-center GPU */
#define PCI_CLASS_ACCELERATOR 0x12   /* processing accelerators: AMD Instinct */
#define MPOL_PREFERRED_MODE 1        /* linux/mempolicy.h, not a libc header everywhere */
#define MAX_NODES 1024

/* The hex number in a sysfs attribute file, or -1. */
static long read_hex(const char *path)
{
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    unsigned long v = 0;
    int ok = fscanf(f, "%lx", &v) == 1;
    fclose(f);
    return ok ? (long)v : -1;
}

int tms_topology_host_gpus(const char *sysfs)
{
    char path[512];
    snprintf(path, sizeof path, "%s/bus/pci/devices", sysfs);
    DIR *dir = opendir(path);
    if (!dir) return 0;
    int gpus = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/bus/pci/devices/%s/vendor", sysfs, e->d_name);
        long vendor = read_hex(path);
        if (vendor != PCI_VENDOR_NVIDIA && vendor != PCI_VENDOR_AMD) continue;
        snprintf(path, sizeof path, "%s/bus/pci/devices/%s/class", sysfs, e->d_name);
        long class_code = read_hex(path);  /* base, sub and interface bytes */
        if (class_code < 0) continue;
        long base_class = class_code >> 16;
        if (base_class == PCI_CLASS_DISPLAY || base_class == PCI_CLASS_ACCELERATOR) gpus++;
    }
    closedir(dir);
    return gpus;
}

int tms_topology_pci_numa_node(const char *sysfs, const char *bus_id)
{
    unsigned domain, bus, device, function;
    char tail;
    if (!bus_id || sscanf(bus_id, "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &tail) != 4) return -1;
    char path[512];
    /* sysfs names a device by its domain in at least 4 digits, lower case
     * (VMD domains take 5); drivers may print 8 with leading zeros. */
    snprintf(path, sizeof path, "%s/bus/pci/devices/%04x:%02x:%02x.%x/numa_node", sysfs, domain, bus, device,
             function);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    int node = -1;
    if (fscanf(f, "%d", &node) != 1 || node < 0 || node >= MAX_NODES) node = -1;
    fclose(f);
    return node;
}

int tms_topology_prefer_node(void *p, size_t size, int node)
{
    if (node < 0 || node >= MAX_NODES) return EINVAL;
    unsigned long mask[MAX_NODES / (8 * sizeof(unsigned long))] = {0};
    mask[node / (8 * sizeof mask[0])] = 1ul << (node % (8 * sizeof mask[0]));
    /* glibc has no mbind wrapper (libnuma has; no new dependency for it). The
     * kernel reads maxnode - 1 bits of the mask. Containers under Docker's
     * default seccomp profile get EPERM: the backup then goes where it falls. */
    if (syscall(SYS_mbind, p, size, MPOL_PREFERRED_MODE, mask, (unsigned long)MAX_NODES + 1, 0u) != 0) return errno;
    return 0;
}
