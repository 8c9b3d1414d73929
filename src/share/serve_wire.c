/* What crosses the sender's sockets whichever protocol answers: a request read and handed to its protocol, a message with descriptors, a refusal before a hang-up. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "share/serve.h"
#include "share/wire.h"

int tms_share_send(int fd, const void *buf, size_t len, const int *fds, int n_fds, int flags)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    union {
        char buf[CMSG_SPACE(sizeof(int) * TMS_JOB_MAX_PIECES)];
        struct cmsghdr align;
    } control;
    if (n_fds < 0 || n_fds > TMS_JOB_MAX_PIECES) return -1;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (n_fds > 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)n_fds);
    }
    ssize_t n;
    do n = sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)len ? 0 : -1;
}

int tms_serve_send_reply(int fd, const struct tms_share_reply *reply, int flags)
{
    return tms_share_send(fd, reply, offsetof(struct tms_share_reply, lens), NULL, 0, flags);
}

/* Tells a receiver of this user why it gets nothing, if it listens, and hangs
 * up. What it asked is read first: a socket closed with a message unread
 * resets the connection, and the receiver would see the reset, not the reply. */
void tms_serve_refuse(int fd, const char *why, int busy)
{
    struct tms_share_reply reply = {.status = TMS_E_STATE, .flags = busy ? TMS_SHARE_REPLY_BUSY : 0};
    snprintf(reply.message, sizeof reply.message, "%s", why);
    (void)tms_serve_send_reply(fd, &reply, MSG_DONTWAIT);
    char asked[sizeof(union tms_serve_request)];
    for (int i = 0; i < 4 && recv(fd, asked, sizeof asked, MSG_DONTWAIT) > 0; i++) continue;
    close(fd);
}

struct tms_serve_outcome tms_serve_answer(int fd, int pid, const struct tms_serve_listener *l,
                                          const struct tms_serve_protocol *const *known, size_t n_known)
{
    struct tms_serve_outcome out = {.fd = fd, .refused = 1};
    union tms_serve_request msg;
    ssize_t n;
    do n = recv(fd, &msg, sizeof msg, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    for (size_t i = 0; n >= 8 && i < n_known; i++) {
        if (memcmp(&msg, known[i]->magic, 8) != 0) continue;
        out = known[i]->answer(fd, pid, l, &msg, (size_t)n);
        out.protocol = known[i];
        break;
    }
    return out;
}
