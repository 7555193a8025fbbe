#include <stdio.h>
int main(void) { printf("compiled %d\n", 6 * 7); return 0; }
